"""The optimizer service: applies pushed gradients to rows and slots stored in memcached."""
