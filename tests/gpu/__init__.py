"""Tests that need a CUDA device (marker `cuda`); each skips cleanly on a machine without one."""
