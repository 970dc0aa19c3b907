"""The host step: ``HostCore`` (the request table and the step's host half), the ``Scheduler``,
the persistent ``InputBatch`` rows, the device batch builder (``batch``), the step reader
(``readback``) and the cascade planner. The engine and the simulator both run this code."""
