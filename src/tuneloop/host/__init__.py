"""The machine and the process: what the hardware has, the host allocator, the CPU's kernel caches, and the import
noise of other libraries."""
