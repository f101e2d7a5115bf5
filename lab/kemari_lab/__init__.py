"""kemari lab: real Linux guests on emulated hardware-virtualization hosts.

A *virtual host* is a QEMU/TCG machine with an emulated AMD-V CPU
(``-cpu EPYC,+svm``) running the Debian cloud kernel with kvm-amd loaded, so it
has a real ``/dev/kvm``. Inside it kemari (or QEMU, for comparison) boots the
same Debian kernel as a guest. See docs/lab.md.
"""

from kemari_lab.errors import LabError

__all__ = ["LabError"]
