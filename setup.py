from setuptools import find_packages, setup

setup(
    name="computron",
    version="0.1.0",
    description="Serve many deep-learning models on shared GPUs by model-parallel swapping",
    packages=find_packages(include=["computron", "computron.*"]),
    python_requires=">=3.10",
    install_requires=["torch>=2.11", "transformers>=5,<6", "numpy", "safetensors"],
    extras_require={
        "experiments": ["matplotlib"],
        "test": ["pytest", "pytest-timeout", "psutil"],
        "launcher": ["psutil", "click", "fabric"],
    },
)
