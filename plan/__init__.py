"""Planning which jobs share which GPU groups: phase profiles and a simulator of the protocol."""
