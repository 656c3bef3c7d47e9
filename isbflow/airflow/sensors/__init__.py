"""Sensors: tasks that wait for a pipeline's steps (deferrable: they wait in the triggerer)."""
