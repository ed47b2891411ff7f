"""Planning: the memory arithmetic of every ZeRO policy (memory.py), the activation probe (activations.py) and
the `zoff estimate` report (estimate.py). Pure functions over meta-device models: no process group, no memory."""
