"""Package discovery (the rest of the build is in pyproject.toml): every package under
megatronish/, and kernels/ with any subpackages installed as megatronish_kernels, since PyPI's
`kernels` is another project. kernels/ has no __init__.py (see kernels/functions.py), so it is
named here rather than found."""

from setuptools import find_packages, setup

kernel_packages = [f"megatronish_kernels.{name}" for name in find_packages("kernels")]
setup(
    packages=[*find_packages(include=["megatronish", "megatronish.*"]), "megatronish_kernels"]
    + kernel_packages,
    package_dir={"megatronish_kernels": "kernels"},
)
