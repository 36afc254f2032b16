"""retrace.engines: the engine bundle format (manifest, hashes, load/verify). No torch, no onnxruntime."""

from retrace.engines.bundle import (
    FORMAT,
    FORMAT_VERSION,
    MANIFEST,
    Bundle,
    BundleError,
    check_files,
    read_manifest,
    sha256_file,
    verify,
    write_manifest,
)

__all__ = ["FORMAT", "FORMAT_VERSION", "MANIFEST", "Bundle", "BundleError", "check_files", "read_manifest",
           "sha256_file", "verify", "write_manifest"]
