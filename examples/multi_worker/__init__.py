"""Custom training loop under MultiWorkerMirroredStrategy with checkpoint resume."""
