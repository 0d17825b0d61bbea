"""The measurement kit every chapter benchmark is built from.

`models.load_model(name)` (a shipped checkpoint or a seeded stand-in of its shape), `workload` (named workload
presets), `driver` (feeds requests to any engine over time) and `check` (same tokens as a baseline).
"""
