"""tandem: an inference server for hybrid GDN + attention models with exact, layered caches."""

__version__ = "0.1.0"
