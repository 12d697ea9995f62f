"""What a run reports: FLOPs and MFU, the metrics writer and its sinks, run records, profiling."""
