"""Finding, opening and naming the sources: rank folders, MindFormers saves, export folders, digests."""
