"""The engine's communication: collectives (Comm), the gradient reductions and their landings, stage 3's
block-by-block gathers and the checks that name a block some rank skipped."""
