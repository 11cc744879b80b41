"""What a round costs, at run time: the terms of a round and the one formula over them
(round_terms.py), checkpoint terms and closed forms, the tables measured at start-up (round_costs.py,
checkpoint_costs.py, startup.py). The engine, `auto` and the offline simulator (`hybridspec.sim`) import them."""
