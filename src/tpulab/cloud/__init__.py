"""Cloud TPU operations through the real gcloud CLI: lifecycle, call records, experiment log."""
