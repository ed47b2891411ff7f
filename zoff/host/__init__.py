"""What describes the host zoff runs on, read by the layers above: where zoff caches what it builds (cache),
where the installed torch stands against the releases zoff is checked on (versions), and how fast its CPU
computes each 16-bit matmul (kernels)."""
