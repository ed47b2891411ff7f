"""Starting a run's ranks: torch.distributed elastic's launcher with zoff's restarts and stops (elastic), and
what the ranks' stores and sockets listen on (network)."""
