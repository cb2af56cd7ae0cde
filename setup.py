from setuptools import find_packages, setup

setup(
    name="computron",
    version="0.1.0",
    description="Serve many deep-learning models on shared GPUs by model-parallel swapping",
    packages=find_packages(include=["computron", "computron.*"]),
    package_data={"computron.server": ["static/*.html"]},
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
    },
)
