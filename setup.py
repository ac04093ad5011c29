"""tessera: a multi-process serving runtime for Qwen2-VL, Qwen2.5-VL and Qwen3-VL."""

from __future__ import annotations

from setuptools import find_packages, setup

# The mission's top-level folders; every package below them ships (tests import them all).
TOP_LEVEL = ["runtime", "tokenizer_manager", "scheduler", "vision", "kernels"]

setup(
    name="tessera",
    version="0.1.0",
    description="Serve Qwen2-VL / Qwen2.5-VL / Qwen3-VL over TP ranks with a data-parallel ViT",
    python_requires=">=3.10",
    packages=find_packages(include=[p for top in TOP_LEVEL for p in (top, f"{top}.*")]),
    py_modules=["launch"],
    # torch is deliberately unpinned here: a GPU user's CUDA build satisfies it untouched.
    # scripts/install.sh installs the CPU build 2.13.0 first on a machine that has no torch.
    install_requires=[
        "torch>=2.4",
        "transformers>=5.0,<6",
        "tokenizers>=0.20",
        "safetensors>=0.4",
        "numpy>=1.26",
        "pillow>=10",
        "pybase64>=1.3",
        "tqdm",
        "jinja2",
        "orjson>=3.9",
        "pyzmq>=25",
        "fastapi>=0.110",
        "starlette>=0.36",  # fastapi's ASGI toolkit; api/sse.py's EventStream builds on it
        "pydantic>=2",
        "uvicorn>=0.29",
        "httptools>=0.6",  # uvicorn's C HTTP parser, used when installed (h11 otherwise)
        "uvloop>=0.19",  # the HTTP server's event loop (launch.py)
        "av>=12",
        "httpx>=0.27",
        "httpcore>=1.0",
        "prometheus_client>=0.20",
        "llguidance>=1.0",  # the grammar engine for structured outputs (runtime/grammar/)
        "xxhash>=3.4",  # the 128-bit media digest (XXH3)
    ],
    extras_require={
        # what only the tests and the benchmarks under scripts/ import
        "test": [
            "pytest>=8",
            "pytest-timeout",
            "pytest-xdist>=3.5",  # the suite runs on two workers, a test file each
            "openai>=1.40",
            "ruff",
            "triton>=3.0",
            "matplotlib",
            "aiohttp>=3.9",  # scripts/bench_serving.py's client
            "decord>=0.6.0; platform_machine == 'x86_64'",  # the video tests' reference reader
            "jsonschema>=4",  # tests/test_grammar.py validates constrained outputs
            "sglang-router>=0.3",  # tests/test_router.py runs the router in front of two servers
        ],
        "gpu": ["triton>=3.0", "flashinfer-python"],
    },
)
