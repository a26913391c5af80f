"""Builds the optional compiled fingerprint kernel; the project's metadata lives in pyproject.toml.

``optional=True``: without a C compiler or Python's headers the build of the extension is skipped
with a warning, the install goes on, and the fingerprint runs on numpy (same digests, slower).
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("reshard_job.core._fingerprint_c", ["reshard_job/core/_fingerprint_c.c"],
                             optional=True)])
