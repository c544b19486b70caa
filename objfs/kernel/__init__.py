"""objfs's own FUSE transport: the kernel's FUSE protocol spoken directly over ``/dev/fuse``."""
