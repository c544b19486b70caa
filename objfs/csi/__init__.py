"""``objfs csi``: a CSI node plugin that mounts for unprivileged objfs sidecars.

The node plugin (privileged, one per node) opens ``/dev/fuse``, mounts each published volume
read-only on the kubelet's target path with ``fd=N``, and offers that fd on a Unix socket in
the pod's ``objfs-fd`` emptyDir (protocol: :mod:`objfs.fdpass`). The pod's ``objfs sidecar
--fd-dir`` (no capabilities, any uid) takes the fd and serves it with the pod's own
credentials. Modules:

* :mod:`objfs.csi.proto`: the CSI v1 messages and services, described by hand (no generated
  code), and a small client;
* :mod:`objfs.csi.volume`: volume attributes checked and turned into ``objfs mount`` options;
* :mod:`objfs.csi.fusemount`: mount(2)/umount2(2) of a FUSE fd, and mountinfo lookups;
* :mod:`objfs.csi.publication`: a published target's states and their allowed changes;
* :mod:`objfs.csi.offers`: the thread per target that offers its fd to the sidecar;
* :mod:`objfs.csi.state`: the state files, and recovery after a restart;
* :mod:`objfs.csi.node`: the Identity and Node services (gRPC) and ``run_csi``.

Needs the ``csi`` extra (grpcio, protobuf).
"""

from __future__ import annotations

#: The CSI driver name (GetPluginInfo; the CSIDriver object and volumes use it).
DRIVER_NAME = "csi.objfs.dev"
