"""The Ray executor: one rank task per Ray task, on the cluster's nodes."""
