"""What `pip install` gives a user who is not in a source checkout: the wheel's package (setup.py's build_py copies
csrc/ into flashrl_kernels/native/csrc) and the sdist. The suite itself runs from an editable install, which reads
csrc/ at the repository root, so without these tests a wheel that forgot a header would only fail on a user's first
CPU op call (and fall back to torch with a warning)."""
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from flashrl_kernels import _backend, _native

ROOT = Path(__file__).resolve().parents[1]
SHIPPED_SUFFIXES = (".cpp", ".h", ".hpp")


def _csrc_files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes()
            for p in sorted(root.rglob("*")) if p.is_file() and p.suffix in SHIPPED_SUFFIXES}


def _setup_py(*args):
    r = subprocess.run([sys.executable, "setup.py", "-q", *args], cwd=ROOT, capture_output=True, text=True,
                       timeout=300, check=False)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]


@pytest.mark.skipif(not _backend.native_built(), reason=f"native CPU kernels not built here: "
                                                        f"{_native.native_status().reason}")
def test_the_installed_package_builds_from_its_own_sources_into_the_same_library(tmp_path):
    """The package as a wheel lays it out, imported from outside the checkout, finds its shipped sources and gets the
    very library this suite built (a cache hit: the build key hashes every source and header, so one file missing
    or different would be a new key and a new compile) and runs an op against the float64 reference."""
    lib = tmp_path / "lib"
    _setup_py("build_py", "--build-lib", str(lib))
    shipped = lib / "flashrl_kernels" / "native" / "csrc"
    assert _csrc_files(shipped) == _csrc_files(ROOT / "csrc") and _csrc_files(shipped)
    script = (
        "import json, torch, flashrl_kernels as fk\n"
        "from flashrl_kernels import _native\n"
        "from flashrl_kernels.reference import token_logprobs_spec\n"
        "st = fk.native_status(load=True)\n"
        "torch.manual_seed(0)\n"
        "logits, targets = torch.randn(5, 3001) * 3, torch.randint(0, 3001, (5,))\n"
        "with fk.use_backend('native'):\n"
        "    lp = fk.token_logprobs(logits, targets)\n"
        "err = (lp.double() - token_logprobs_spec(logits.double(), targets, 1.0, None)[0]).abs().max().item()\n"
        "print(json.dumps({'package': fk.__file__, 'sources': str(_native.source_dir()), 'loaded': st.loaded,\n"
        "                  'cached': st.cached, 'library': st.library, 'err': err}))\n"
    )
    suite_library = Path(_native.native_status().library)
    env = {**os.environ, "PYTHONPATH": str(lib), "FLASHRL_CACHE_DIR": str(suite_library.parent.parent)}
    env.pop("FLASHRL_BACKEND", None)
    r = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=300, check=False)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["package"] == str(lib / "flashrl_kernels" / "__init__.py"), out
    assert out["sources"] == str(shipped), out
    assert out["loaded"] and out["cached"] and out["library"] == str(suite_library), out
    assert out["err"] < 1e-5, out


def test_the_sdist_holds_the_sources_and_what_the_build_needs(tmp_path):
    _setup_py("sdist", "--dist-dir", str(tmp_path))
    (archive,) = tmp_path.glob("flashrl_kernels-*.tar.gz")
    with tarfile.open(archive) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    want = {f"csrc/{name}" for name in _csrc_files(ROOT / "csrc")}
    assert want and want <= names, sorted(want - names)
    assert {"setup.py", "pyproject.toml", "README.md", "flashrl_kernels/__init__.py", "flashrl_kernels/_native.py",
            "flashrl_kernels/integrations/vllm/__init__.py"} <= names
