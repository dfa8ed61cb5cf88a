"""The skip every etcd test shares: it needs Debian's etcd-server (``make system-packages``)."""

from __future__ import annotations

import pytest

from deploy.local_etcd import etcd_binary

needs_etcd = pytest.mark.skipif(
    etcd_binary() is None,
    reason="no etcd binary: install Debian's etcd-server (make system-packages as root)",
)
