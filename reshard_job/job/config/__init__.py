"""The job's configuration: the Hydra schema, settling it into a typed JobSpec."""
