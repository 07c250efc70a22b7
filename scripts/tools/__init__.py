"""The course's tools: the cluster launcher, the data download, the GPU check and the course run."""
