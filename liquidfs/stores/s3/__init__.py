"""The S3 backend: a dataset and its store in an S3-compatible object store (AWS S3, Ceph RGW, MinIO, Swift's
s3api), ``s3://BUCKET/PREFIX``.

* ``client``: talking to the object store: URLs, clients, listings, GETs checked against the question;
* ``store``: the ``Store``: the catalog built from listings and kept in the store, objects put by prepare's workers;
* ``reader``: what a mount serves from the bucket: the raw object when sound, else the original.
"""

from __future__ import annotations

from .store import BucketStore

__all__ = ["BucketStore"]
