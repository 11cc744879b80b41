"""Ring snapshots of recurrent state: where a verify forward's snapshots go (ring.py), how every
recurrent layer returns to the accepted boundary (restore.py: ring head move, log or token replay),
the three verbs the round speaks (checkpointer.py: plan, commit, revert), the policies that trade
memory for replay (policy.py, auto.py) and the measurement of their costs (measure.py)."""
