"""The plumbing every Timeslice process uses to talk to Temporal: the connection (a client with
the pydantic converter, the codec and the tracing interceptor), updates sent without the SDK's
retries, telemetry (tracing, OTLP export, the Prometheus endpoint) and the optional payload
codec.

Nothing here knows of leases, groups' decisions or the user API: the client engine, the job
runtime, the workers and the CLI build on it.
"""
