"""The trainer: one session per rank (session.py) driving the one fixed loop (loop.py), with its schedule,
metrics, plots and preemption handling."""
