from setuptools import find_packages, setup

setup(
    name="computron",
    version="0.1.0",
    description="Serve many deep-learning models on shared GPUs by model-parallel swapping",
    packages=find_packages(include=["computron", "computron.*"]),
    package_data={"computron.server": ["static/*.html"], "computron.kernels.cpu": ["*.c"]},
    entry_points={"console_scripts": ["computron = computron.server.cli:console"]},
    python_requires=">=3.10",
    install_requires=["torch>=2.11", "transformers>=5,<6", "numpy", "safetensors", "tokenizers", "pyyaml",
                      "fastapi", "uvicorn", "prometheus_client", "pillow", "peft"],
    extras_require={
        "experiments": ["matplotlib"],
        "test": ["pytest>=8.3,<9", "pytest-timeout", "pytest-xdist", "psutil", "openai", "httpx", "selenium",
                 "tritonclient[http]", "ruff", "gguf>=0.10"],
        "gguf": ["gguf>=0.10"],  # serving .gguf files (computron/storage/gguf.py)
        "launcher": ["psutil", "click", "fabric"],
        "ray": ["ray>=2.40"],
        # tests/clients; plus instructor==1.17.0 installed with --no-deps (its jiter<0.15 pin conflicts with
        # openai>=3.60; the Makefile installs it so)
        "clients": ["lm-eval==0.4.13", "guidellm==0.8.1", "langchain-core==1.8.1", "langchain-openai==1.7.4",
                    "openai-agents==0.24.0", "docstring-parser"],
    },
)
