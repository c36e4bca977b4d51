"""Device-side parts shared by the architectures: layouts, online softmax, masks, sequence info."""
