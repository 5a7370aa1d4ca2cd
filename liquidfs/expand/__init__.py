"""Image formats and their lossless expansion to raw formats: sniffing, the raw formats' records, one image's
expansion and check, and how many workers fit."""
