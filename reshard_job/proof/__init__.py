"""Proving what a checkpoint holds, whatever its layout: parameter fingerprints gathered from files
(``collect``) and compared (``compare``). The algebra is ``reshard_job.core.fingerprint``."""
