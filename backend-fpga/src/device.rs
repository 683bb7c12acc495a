//! The real MMIO: a vFPGA device file (`/dev/coyote_fpga_<dev>_v<vfid>`) whose config region
//! is `mmap`ed and accessed with volatile 64-bit loads and stores.

use crate::driver::{self, CoyoteDriver, DriverError, ShellConfig, MAX_USER_ARGS, N_CTID_MAX};
use crate::mmio::{Mmio, MmioError};
use crate::regs;
use std::ffi::CString;
use std::fmt;
use std::path::{Path, PathBuf};

/// Where the registers are.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceConfig {
    pub path: PathBuf,
    /// `mmap` offset of the config region on the device file (Coyote: `MMAP_CNFG` = 0x1000).
    pub offset: u64,
    /// Bytes to map (Coyote: `CNFG_REGION_SIZE` = 64 KiB).
    pub len: usize,
}

impl DeviceConfig {
    /// Coyote's naming: `/dev/coyote_fpga_<device>_v<vfid>`, the legacy config region at
    /// `MMAP_CNFG`.
    pub fn coyote(device: u32, vfid: u8) -> Self {
        DeviceConfig {
            path: PathBuf::from(format!("/dev/coyote_fpga_{device}_v{vfid}")),
            offset: regs::MMAP_CNFG_OFFSET,
            len: regs::CNFG_REGION_WORDS * 8,
        }
    }
    /// The same vFPGA's user CSR region (`MMAP_CTRL`, 64 KiB): where the omw extension
    /// block's registers are.
    pub fn coyote_user_csr(device: u32, vfid: u8) -> Self {
        DeviceConfig { offset: regs::MMAP_CTRL_OFFSET, len: regs::CTRL_REGION_WORDS * 8, ..Self::coyote(device, vfid) }
    }
}

#[derive(Debug)]
#[non_exhaustive]
pub enum DeviceError {
    /// The device file does not exist: no FPGA, no driver loaded, or the wrong device/vFPGA.
    NotFound {
        path: PathBuf,
    },
    PermissionDenied {
        path: PathBuf,
    },
    Open {
        path: PathBuf,
        err: std::io::Error,
    },
    /// `mmap` of the register region failed.
    Map {
        path: PathBuf,
        offset: u64,
        len: usize,
        err: std::io::Error,
    },
    /// Offset or length unusable (not page aligned, zero, not a multiple of 8).
    BadRegion {
        offset: u64,
        len: usize,
    },
}

impl fmt::Display for DeviceError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DeviceError::NotFound { path } => write!(
                f,
                "FPGA device file {} does not exist: is the Coyote driver loaded and the vFPGA id right?",
                path.display()
            ),
            DeviceError::PermissionDenied { path } => {
                write!(f, "no permission to open FPGA device file {} (needs read/write)", path.display())
            }
            DeviceError::Open { path, err } => write!(f, "cannot open FPGA device file {}: {err}", path.display()),
            DeviceError::Map { path, offset, len, err } => {
                write!(f, "cannot mmap {len} bytes at offset {offset:#x} of {}: {err}", path.display())
            }
            DeviceError::BadRegion { offset, len } => {
                write!(f, "register region offset {offset:#x} / length {len} must be page aligned and non-empty")
            }
        }
    }
}

impl std::error::Error for DeviceError {}

/// Open both register regions of a Coyote vFPGA the shim uses: the legacy config region and
/// the user CSR region (`FpgaBackend::open(cnfg, user_csr, ..)`).
pub fn open_vfpga(device: u32, vfid: u8) -> Result<(DevMmio, DevMmio), DeviceError> {
    Ok((
        DevMmio::open(&DeviceConfig::coyote(device, vfid))?,
        DevMmio::open(&DeviceConfig::coyote_user_csr(device, vfid))?,
    ))
}

/// One register region of one vFPGA, mapped from its device file.
#[derive(Debug)]
pub struct DevMmio {
    fd: libc::c_int,
    base: *mut u64,
    words: usize,
    path: PathBuf,
}

impl DevMmio {
    /// Open and map. Fails with [`DeviceError::NotFound`] when the file does not exist; no
    /// register is touched by opening.
    pub fn open(cfg: &DeviceConfig) -> Result<Self, DeviceError> {
        // SAFETY: sysconf has no memory-safety preconditions
        let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) }.max(4096) as u64;
        if cfg.len == 0 || !cfg.len.is_multiple_of(8) || !cfg.offset.is_multiple_of(page) {
            return Err(DeviceError::BadRegion { offset: cfg.offset, len: cfg.len });
        }
        let path = cfg.path.clone();
        let c = CString::new(path.as_os_str().as_encoded_bytes())
            .map_err(|_| DeviceError::NotFound { path: path.clone() })?;
        // SAFETY: `c` is a valid NUL-terminated string for the duration of the call
        let fd = unsafe { libc::open(c.as_ptr(), libc::O_RDWR | libc::O_SYNC | libc::O_CLOEXEC) };
        if fd < 0 {
            let err = std::io::Error::last_os_error();
            return Err(match err.kind() {
                std::io::ErrorKind::NotFound => DeviceError::NotFound { path },
                std::io::ErrorKind::PermissionDenied => DeviceError::PermissionDenied { path },
                _ => DeviceError::Open { path, err },
            });
        }
        // SAFETY: fd is open; a failed mapping is reported as MAP_FAILED and checked below
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                cfg.len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd,
                cfg.offset as libc::off_t,
            )
        };
        if p == libc::MAP_FAILED {
            let err = std::io::Error::last_os_error();
            // SAFETY: fd is ours and open
            unsafe { libc::close(fd) };
            return Err(DeviceError::Map { path, offset: cfg.offset, len: cfg.len, err });
        }
        Ok(DevMmio { fd, base: p as *mut u64, words: cfg.len / 8, path })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
    pub fn words(&self) -> usize {
        self.words
    }
}

impl Mmio for DevMmio {
    fn read_csr(&self, reg: usize) -> Result<u64, MmioError> {
        if reg >= self.words {
            return Err(MmioError::OutOfRange { reg, words: self.words });
        }
        // SAFETY: reg < words, the mapping is `words` 64-bit registers long and stays mapped
        // until drop; device registers need volatile access
        Ok(unsafe { std::ptr::read_volatile(self.base.add(reg)) })
    }
    fn write_csr(&self, reg: usize, value: u64) -> Result<(), MmioError> {
        if reg >= self.words {
            return Err(MmioError::OutOfRange { reg, words: self.words });
        }
        // SAFETY: as in read_csr
        unsafe { std::ptr::write_volatile(self.base.add(reg), value) };
        Ok(())
    }
}

impl DevMmio {
    fn ioctl(&self, name: &'static str, request: u64, args: &mut [u64; MAX_USER_ARGS]) -> Result<(), DriverError> {
        // SAFETY: fd is open for the lifetime of self; every Coyote ioctl reads and writes at
        // most MAX_USER_ARGS u64s through the pointer (`copy_from_user(tmp, arg, ...)` of
        // `uint64_t tmp[MAX_USER_ARGS]`), and `args` is exactly that long and lives across the call
        let r = unsafe { libc::ioctl(self.fd, request as _, args.as_mut_ptr()) };
        if r < 0 {
            return Err(DriverError::Ioctl {
                name,
                errno: std::io::Error::last_os_error().raw_os_error().unwrap_or(0),
            });
        }
        Ok(())
    }
}

impl CoyoteDriver for DevMmio {
    fn shell_config(&self) -> Result<ShellConfig, DriverError> {
        let mut a = [0u64; MAX_USER_ARGS];
        self.ioctl("IOCTL_READ_SHELL_CONFIG", driver::IOCTL_READ_SHELL_CONFIG, &mut a)?;
        Ok(ShellConfig::parse(a[0]))
    }
    fn register_ctid(&self, hpid: u32) -> Result<u8, DriverError> {
        let mut a = [0u64; MAX_USER_ARGS];
        a[0] = hpid as u64;
        self.ioctl("IOCTL_REGISTER_CTID", driver::IOCTL_REGISTER_CTID, &mut a)?;
        if a[1] >= N_CTID_MAX as u64 {
            return Err(DriverError::BadCtid(a[1]));
        }
        Ok(a[1] as u8)
    }
    fn unregister_ctid(&self, ctid: u8) -> Result<(), DriverError> {
        let mut a = [0u64; MAX_USER_ARGS];
        a[0] = ctid as u64;
        self.ioctl("IOCTL_UNREGISTER_CTID", driver::IOCTL_UNREGISTER_CTID, &mut a)
    }
    fn ip_address(&self) -> Result<u32, DriverError> {
        let mut a = [0u64; MAX_USER_ARGS];
        self.ioctl("IOCTL_GET_IP_ADDRESS", driver::IOCTL_GET_IP_ADDRESS, &mut a)?;
        Ok(a[0] as u32)
    }
}

impl Drop for DevMmio {
    fn drop(&mut self) {
        // SAFETY: base/len are the mapping made in open; fd is ours
        unsafe {
            libc::munmap(self.base as *mut libc::c_void, self.words * 8);
            libc::close(self.fd);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_device_is_a_clear_error() {
        let cfg = DeviceConfig { path: "/dev/omw-no-such-fpga".into(), ..DeviceConfig::coyote(0, 0) };
        let e = DevMmio::open(&cfg).unwrap_err();
        assert!(matches!(e, DeviceError::NotFound { .. }), "{e:?}");
        assert!(e.to_string().contains("/dev/omw-no-such-fpga"));
        assert!(e.to_string().contains("does not exist"));
    }

    #[test]
    fn bad_region_rejected_before_open() {
        let cfg = DeviceConfig { path: "/dev/null".into(), offset: 3, len: 8 };
        assert!(matches!(DevMmio::open(&cfg), Err(DeviceError::BadRegion { .. })));
    }

    #[test]
    fn maps_a_plain_file() {
        // a regular file stands in for the device: registers are 64-bit words of it
        let dir = std::env::temp_dir().join(format!("omw-fpga-devmmio-{}", std::process::id()));
        std::fs::write(&dir, vec![0u8; 8192]).unwrap();
        let cfg = DeviceConfig { path: dir.clone(), offset: 4096, len: 4096 };
        let m = DevMmio::open(&cfg).unwrap();
        m.write_csr(3, 0xdead_beef).unwrap();
        assert_eq!(m.read_csr(3).unwrap(), 0xdead_beef);
        assert_eq!(m.read_csr(512), Err(MmioError::OutOfRange { reg: 512, words: 512 }));
        drop(m);
        let bytes = std::fs::read(&dir).unwrap();
        assert_eq!(&bytes[4096 + 24..4096 + 32], &0xdead_beefu64.to_le_bytes());
        let _ = std::fs::remove_file(&dir);
    }

    #[test]
    fn ioctl_on_a_plain_file_is_a_typed_error() {
        let dir = std::env::temp_dir().join(format!("omw-fpga-devioctl-{}", std::process::id()));
        std::fs::write(&dir, vec![0u8; 8192]).unwrap();
        let m = DevMmio::open(&DeviceConfig { path: dir.clone(), offset: 4096, len: 4096 }).unwrap();
        let e = m.shell_config().unwrap_err();
        assert!(
            matches!(e, DriverError::Ioctl { name: "IOCTL_READ_SHELL_CONFIG", errno } if errno == libc::ENOTTY),
            "{e:?}"
        );
        drop(m);
        let _ = std::fs::remove_file(&dir);
    }
}
