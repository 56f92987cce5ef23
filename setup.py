"""The package list, the one thing pyproject.toml cannot say: the model zoo's folder `models/`
installs as `moetrain.models` (a top-level `models` would collide with any other on a user's path),
and every family folder in it is found, so adding one needs no edit here. The rest: pyproject.toml."""
from setuptools import find_packages, setup

ZOO = "models"

setup(packages=find_packages(include=["moetrain", "moetrain.*"])
      + [f"moetrain.{name}" for name in find_packages(include=[ZOO, f"{ZOO}.*"])],
      package_dir={f"moetrain.{ZOO}": ZOO})
