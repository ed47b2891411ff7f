"""The trainer: one session per rank (session.py) driving the one fixed loop (loop.py), started, resumed and
summed up by run.py, with its start-up plan (plan_banner.py), activation offload, schedule, metrics, plots and
preemption handling."""
