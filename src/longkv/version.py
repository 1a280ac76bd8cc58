"""The installed longkv's version, without importing torch."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("longkv")
except PackageNotFoundError:  # the sources on sys.path without an installed distribution
    __version__ = "0+unknown"
