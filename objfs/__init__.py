"""objfs: mount an object-store bucket/prefix as a read-only POSIX directory."""

__version__ = "0.1.0"
