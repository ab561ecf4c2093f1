"""Which jobs should share which GPU groups (``timeslice plan``, docs/plan.md).

``profile``: a job's phase profile (pydantic, YAML / JSON); ``collect``: profiles from real
runs (RL jobs' histories, clients' leases); ``simulator``: a discrete-event simulator of the
protocol; ``search``: assignments of jobs to groups, scored by the simulator; ``timeline``: a
simulated run drawn by the report; ``cli``: the command.
"""
