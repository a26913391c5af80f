"""The names of an output directory's manifests, spelled once for the side that writes them
(``job.output``) and the side that reads them (``audit``).

``manifest.json`` is the commit marker of an output directory: the job writes it last, after
every target file and the target strategy, listing each of them with its size and sha256, so a
directory that has it is complete and one that lacks it is not (yet) an output of reshard_job.
With ``output.placement=per_node`` each target node also gets ``manifest.<node>.json``, the
manifest of that node's files, next to them.

It lives in the formats layer, below both readers and writers, so that neither has to import
the other to agree on a file name.
"""

MANIFEST_FILE = "manifest.json"

NODE_MANIFEST_PREFIX = "manifest."
NODE_MANIFEST_SUFFIX = ".json"


def is_node_manifest_name(name: str) -> bool:
    """Whether a file name has the form of a node's manifest (``manifest.<node>.json``)."""
    return name.startswith(NODE_MANIFEST_PREFIX) and name.endswith(NODE_MANIFEST_SUFFIX) and name != MANIFEST_FILE
