"""The job's stages over typed values: prepare, settle the target, hash, convert, record, report."""
