//! The bare cost of registering guest memory with KVM on this host: one
//! `KVM_SET_USER_MEMORY_REGION` of a fresh memfd mapping, per size, on a
//! fresh VM each time (what a boot does before the guest runs), median of
//! N. `cargo run --release -p vmm --example slot_cost [runs]`.

use std::time::Instant;

use kvm_bindings::kvm_userspace_memory_region;
use kvm_ioctls::Kvm;

fn memfd(size: u64) -> (i32, *mut libc::c_void) {
    // SAFETY: a NUL-terminated name; the flags are valid.
    let fd = unsafe { libc::memfd_create(c"slot-cost".as_ptr(), libc::MFD_CLOEXEC) };
    assert!(fd >= 0, "memfd_create: {}", std::io::Error::last_os_error());
    // SAFETY: fd is the memfd just made.
    assert_eq!(unsafe { libc::ftruncate(fd, size as i64) }, 0);
    // SAFETY: a new shared mapping of the whole memfd; checked below.
    let addr = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            size as usize,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED | libc::MAP_NORESERVE,
            fd,
            0,
        )
    };
    assert_ne!(addr, libc::MAP_FAILED, "mmap");
    (fd, addr)
}

fn main() {
    let runs: usize = std::env::args()
        .nth(1)
        .map_or(15, |s| s.parse().expect("runs"));
    let kvm = Kvm::new().expect("/dev/kvm");
    let sizes: [(u64, &str); 4] = [
        (256 << 20, "256M"),
        (1 << 30, "1G"),
        (4 << 30, "4G"),
        (16 << 30, "16G"),
    ];
    let mut times: Vec<Vec<f64>> = vec![Vec::new(); sizes.len()];
    // Sizes interleaved run by run, so that other load hits all alike.
    for _ in 0..runs {
        for (i, &(size, _)) in sizes.iter().enumerate() {
            let vm = kvm.create_vm().expect("KVM_CREATE_VM");
            let (fd, addr) = memfd(size);
            let region = kvm_userspace_memory_region {
                slot: 0,
                flags: 0,
                guest_phys_addr: 0,
                memory_size: size,
                userspace_addr: addr as u64,
            };
            let t = Instant::now();
            // SAFETY: the region is a live mapping of `size` bytes that
            // outlives the VM (unmapped only after the VM is dropped).
            unsafe { vm.set_user_memory_region(region) }.expect("KVM_SET_USER_MEMORY_REGION");
            times[i].push(t.elapsed().as_secs_f64() * 1000.0);
            drop(vm);
            // SAFETY: the mapping made above, no longer used by any VM.
            unsafe {
                libc::munmap(addr, size as usize);
                libc::close(fd);
            }
        }
    }
    println!("KVM_SET_USER_MEMORY_REGION, one slot, median of {runs} (ms):");
    let mut base = 0.0;
    for (i, &(size, name)) in sizes.iter().enumerate() {
        let t = &mut times[i];
        t.sort_by(f64::total_cmp);
        let median = t[t.len() / 2];
        if i == 0 {
            base = median;
        }
        println!(
            "  {name:>5}  {median:7.3}   +{:.3} ms over 256M   ({:.3} ms/GiB)",
            median - base,
            (median - base) / ((size - (256 << 20)) as f64 / f64::from(1u32 << 30)).max(1e-9)
        );
    }
}
