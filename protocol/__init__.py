"""The wire contract: every message, name and carried state that crosses Temporal.

One leaf package, imported alike by the workflows, the activities, the workers and the client;
it imports nothing of Timeslice but itself (tests/unit/test_layering.py). ``group`` holds the
GPU-group and snapshot messages, ``rl_job`` the RL job's; tests/unit/test_contract.py checks that
every name here has a handler and every handler a name.
"""
