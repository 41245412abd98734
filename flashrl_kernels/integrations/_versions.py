"""The version gate every framework adapter runs before it patches anything."""
from __future__ import annotations


def release_of(version: str) -> tuple[int, ...] | None:
    """(major, minor, micro, ...) of a version string, None when it does not parse."""
    from packaging.version import InvalidVersion, Version

    try:
        return Version(version).release
    except (InvalidVersion, TypeError):
        return None


def require_supported(framework: str, package: str, version: str, supported: bool, supported_range: str,
                      why: str) -> str:
    """Return `version`, or raise RuntimeError naming the supported range and why others are refused."""
    if not supported:
        raise RuntimeError(
            f"flashrl_kernels' {framework} integration supports {package}{supported_range}; found {package} {version}. "
            f"{why}, so it refuses other versions. Install a supported {framework} "
            f"(pip install '{package}{supported_range}') or do not patch.")
    return version


def import_or_explain(framework: str, package: str, supported_range: str):
    """Import `package` or raise RuntimeError telling how to install a supported version."""
    import importlib

    try:
        return importlib.import_module(package)
    except ImportError as e:
        raise RuntimeError(f"flashrl_kernels' {framework} integration needs {package} "
                           f"(pip install '{package}{supported_range}'); importing it failed: {e}") from e
