"""Running a job: distributed start-up, data, optimizer and the training loop."""
