"""Workers of Timeslice: the control worker (group workflows) on task queue ``timeslice``."""

from timeslice.workers.control import build_control_worker, check_search_attributes

__all__ = ["build_control_worker", "check_search_attributes"]
