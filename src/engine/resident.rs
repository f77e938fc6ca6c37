//! Where the CPU backend's weight bytes live: in 2 MiB pages (Linux transparent huge pages,
//! `madvise(MADV_HUGEPAGE)`, kernel docs `admin-guide/mm/transhuge`) rather than 4 KiB ones.
//!
//! A decode step reads every weight once, as a stream, and with 4 KiB pages that stream is set
//! by address translation as much as by DRAM: a TLB miss every 4 KiB and the hardware
//! prefetchers restarting at each page; under a hypervisor (nested paging, the cloud VMs this
//! tool runs on) a miss costs up to 24 memory references. What decides is how the page cache
//! holds the file: on filesystems that cache in large folios (XFS; ext4 from Linux 6.16) a
//! file read ahead from disk sits in them, one just written (a download) in 4 KiB pages.
//!
//! So the file is mapped at a 2 MiB boundary with the advice (`AlignedMap`): the kernel maps
//! whatever the page cache holds in 2 MiB folios with 2 MiB entries, for nothing. With
//! `BOT_HUGEPAGES=copy`, a file whose 64 MiB probe is not so mapped is read into anonymous
//! memory advised the same way (`HugeBuf`) where half the available memory holds it: on this
//! project's Zen 4 VM (docs/performance.md) a freshly written 0.6B model then decoded ~16%
//! faster, for a load ~0.4 s longer (8B: ~10%, 2-10 s), which a one-post `bot generate` does
//! not earn back; hence opt-in. A file on tmpfs is mapped as it is. GPU backends upload the
//! weights and keep the plain map; so does the CPU where huge pages are off (`never`), not
//! 2 MiB, or not Linux.

use std::io::{self, Read};
use std::ops::{Deref, DerefMut};

/// How a model's safetensors files are held in memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Residency {
    /// The file mapped read-only in place: shared with the page cache (and with another `bot`
    /// on the same model), paged in as it is touched.
    Mapped,
    /// Mapped in place at a 2 MiB boundary with the huge-page advice (Linux): the kernel maps
    /// in 2 MiB entries whatever the page cache holds in 2 MiB folios; nothing is copied, and
    /// the load costs what a plain map costs. The default.
    HugeMapped,
    /// As `HugeMapped` where a probe finds 2 MiB entries; otherwise read into private anonymous
    /// memory advised for 2 MiB pages (`BOT_HUGEPAGES=copy`): the fastest decode whatever the
    /// page cache holds, for a load that copies the file (for a long-running process).
    HugeCopied,
}

/// The environment variable that chooses (`off`: plain map; `copy`: `HugeCopied`; anything
/// else or unset: `HugeMapped`).
pub const ENV: &str = "BOT_HUGEPAGES";

impl Residency {
    /// For the CPU backend on Linux where the kernel's transparent huge pages are `always` or
    /// `madvise` in 2 MiB pages: `HugeMapped`, or what `BOT_HUGEPAGES` asks; `Mapped` otherwise
    /// (GPU backends upload the weights once).
    pub fn for_device(dev: &candle_core::Device) -> Self {
        let asked = std::env::var(ENV).unwrap_or_default().to_ascii_lowercase();
        if !dev.is_cpu() || matches!(asked.as_str(), "off" | "0" | "false" | "no") {
            return Residency::Mapped;
        }
        if !huge_pages_usable() {
            return Residency::Mapped;
        }
        if asked == "copy" {
            Residency::HugeCopied
        } else {
            Residency::HugeMapped
        }
    }
}

/// What the CPU backend does with a model's files here, in words (`bot doctor`).
pub fn describe_cpu() -> String {
    let mode = thp_mode();
    let mode = mode.as_deref().unwrap_or("?");
    match Residency::for_device(&candle_core::Device::Cpu) {
        Residency::HugeMapped => format!(
            "mapped in place, in 2 MiB pages where the page cache holds them so (transparent huge pages: {mode}; {ENV}=copy copies the rest, =off maps as is)"
        ),
        Residency::HugeCopied => format!(
            "in 2 MiB pages: mapped where the page cache allows, else copied ({ENV}=copy; transparent huge pages: {mode})"
        ),
        Residency::Mapped => format!("the files mapped in place (transparent huge pages: {mode}; {ENV}: {:?})", std::env::var(ENV).ok()),
    }
}

/// Whether the kernel gives this process 2 MiB transparent huge pages: the mode is `always` or
/// `madvise` and the PMD size is 2 MiB (not so on aarch64 kernels with 16 or 64 KiB base
/// pages, where a `HugeBuf` would be a copy without the gain).
fn huge_pages_usable() -> bool {
    let pmd = std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/hpage_pmd_size");
    matches!(thp_mode().as_deref(), Some("always" | "madvise"))
        && pmd.is_ok_and(|t| t.trim().parse::<usize>() == Ok(HUGE))
}

/// The kernel's transparent huge page mode (`always`, `madvise`, `never`), where it says one.
pub fn thp_mode() -> Option<String> {
    if !cfg!(target_os = "linux") {
        return None;
    }
    let text = std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled").ok()?;
    parse_thp_mode(&text)
}

/// The bracketed word of `/sys/kernel/mm/transparent_hugepage/enabled` (`always [madvise] never`).
pub fn parse_thp_mode(text: &str) -> Option<String> {
    let start = text.find('[')? + 1;
    let len = text[start..].find(']')?;
    Some(text[start..start + len].to_string())
}

/// A huge page's size on x86-64 and aarch64 Linux (4 KiB base pages).
const HUGE: usize = 2 << 20;

#[cfg(target_os = "linux")]
/// How much of a file `AlignedMap::open` populates to see how the page cache holds it: 64 MiB
/// in the middle (read-ahead starts a file in small folios and grows them, so its first
/// megabytes say little about the rest).
const PROBE: usize = 64 << 20;

/// A file mapped read-only at a 2 MiB boundary and advised for huge pages (Linux): where the
/// page cache holds the file in 2 MiB folios (read ahead into it with the advice, or read
/// sequentially before), the kernel maps them with 2 MiB entries, and nothing is copied.
/// Where it holds 4 KiB pages (a file just written, e.g. downloaded) it cannot, and
/// `open` says so: the caller then copies into a `HugeBuf`.
#[cfg(target_os = "linux")]
pub struct AlignedMap {
    /// The reservation (`len` + one huge page); the file is mapped over its aligned part.
    base: *mut libc::c_void,
    reserved: usize,
    start: usize,
    len: usize,
}

// SAFETY: a read-only shared mapping owned by this value until drop; this process never writes
// it. (Another process truncating the file under it would raise SIGBUS on access, as with any
// mapped model file: memmap2's, candle's, llama.cpp's.)
#[cfg(target_os = "linux")]
unsafe impl Send for AlignedMap {}
#[cfg(target_os = "linux")]
unsafe impl Sync for AlignedMap {}

#[cfg(target_os = "linux")]
impl AlignedMap {
    /// Maps `len` bytes of `file` and populates `PROBE` of them in the middle; `Some` when the
    /// kernel mapped at least 75% of that probe with 2 MiB entries, `None` (nothing kept)
    /// otherwise, and for a file on tmpfs or under 2 MiB.
    pub fn open(file: &std::fs::File, len: usize) -> io::Result<Option<Self>> {
        if len < HUGE || on_tmpfs(file) {
            return Ok(None);
        }
        let map = Self::map(file, len)?;
        let (start, probe) = (map.start, (len / HUGE * HUGE).min(PROBE));
        let from = (len / 2).saturating_sub(probe / 2) / HUGE * HUGE;
        // SAFETY: advice on this value's own mapping (`from + probe <= len`); a kernel without
        // MADV_POPULATE_READ (before 5.14) refuses it, and then nothing is kept
        let populated = unsafe {
            let at = (start + from) as *mut libc::c_void;
            libc::madvise(at, probe, libc::MADV_POPULATE_READ) == 0
        };
        let pmd = map.huge_bytes().unwrap_or(0);
        Ok((populated && pmd as f64 >= 0.75 * probe as f64).then_some(map))
    }

    /// `len` bytes of `file` mapped read-only at a 2 MiB boundary and advised for huge pages.
    pub fn map(file: &std::fs::File, len: usize) -> io::Result<Self> {
        use std::os::unix::io::AsRawFd;
        let reserved = len
            .checked_add(HUGE)
            .ok_or_else(|| io::Error::other("file too large to map"))?;
        // SAFETY: a fresh inaccessible reservation; the file is then mapped with MAP_FIXED
        // inside it only, so no other mapping is replaced; every call's result is checked.
        let (base, start) = unsafe {
            let base = libc::mmap(
                std::ptr::null_mut(),
                reserved,
                libc::PROT_NONE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            );
            if base == libc::MAP_FAILED {
                return Err(io::Error::last_os_error());
            }
            let start = (base as usize).next_multiple_of(HUGE);
            let at = libc::mmap(
                start as *mut libc::c_void,
                len.max(1),
                libc::PROT_READ,
                libc::MAP_SHARED | libc::MAP_FIXED,
                file.as_raw_fd(),
                0,
            );
            if at == libc::MAP_FAILED {
                let e = io::Error::last_os_error();
                libc::munmap(base, reserved);
                return Err(e);
            }
            // where the kernel ignores the advice, only speed changes
            libc::madvise(start as *mut libc::c_void, len.max(1), libc::MADV_HUGEPAGE);
            (base, start)
        };
        Ok(AlignedMap {
            base,
            reserved,
            start,
            len,
        })
    }

    /// How many of the mapped bytes the kernel maps with 2 MiB entries now.
    pub fn huge_bytes(&self) -> Option<u64> {
        mapping_field(self.start, "FilePmdMapped:")
    }
}

#[cfg(target_os = "linux")]
impl AsRef<[u8]> for AlignedMap {
    fn as_ref(&self) -> &[u8] {
        // SAFETY: `len` bytes at `start` are this value's read-only mapping of the file.
        unsafe { std::slice::from_raw_parts(self.start as *const u8, self.len) }
    }
}

#[cfg(target_os = "linux")]
impl Drop for AlignedMap {
    fn drop(&mut self) {
        // SAFETY: the whole reservation (the file's mapping lies inside it) is ours.
        unsafe { libc::munmap(self.base, self.reserved) };
    }
}

/// Whether `file` lives on tmpfs, whose pages are already memory (and held as shmem, which
/// neither the probe nor a copy improves).
#[cfg(target_os = "linux")]
fn on_tmpfs(file: &std::fs::File) -> bool {
    use std::os::unix::io::AsRawFd;
    const TMPFS_MAGIC: i64 = 0x0102_1994;
    // SAFETY: fstatfs writes into the struct we pass, for an open descriptor.
    unsafe {
        let mut st: libc::statfs = std::mem::zeroed();
        libc::fstatfs(file.as_raw_fd(), &mut st) == 0 && st.f_type as i64 == TMPFS_MAGIC
    }
}

/// Whether a private copy of `len` bytes leaves room: at most half of what the kernel reports
/// available (`MemAvailable`), so that a model near the machine's memory is mapped (slower)
/// instead of pushed to swap or refused; `true` where the kernel does not say.
pub fn room_for_copy(len: usize) -> bool {
    let text = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    mem_available(&text).is_none_or(|avail| len as u64 <= avail / 2)
}

/// `MemAvailable` of `/proc/meminfo`, in bytes.
fn mem_available(meminfo: &str) -> Option<u64> {
    let line = meminfo.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line["MemAvailable:".len()..]
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()?;
    Some(kib * 1024)
}

/// Zeroed anonymous memory, its start aligned to 2 MiB and advised for huge pages before
/// anything touches it (a page faulted in first stays 4 KiB until khugepaged gets to it).
pub struct HugeBuf {
    map: memmap2::MmapMut,
    start: usize,
    len: usize,
}

impl HugeBuf {
    pub fn zeroed(len: usize) -> io::Result<Self> {
        // whole huge pages from a 2 MiB boundary on (the last piece is one too), and one more
        // to find that boundary in; what is never touched never becomes resident
        let size = len
            .checked_next_multiple_of(HUGE)
            .and_then(|l| l.checked_add(HUGE))
            .ok_or_else(|| io::Error::other("buffer too large"))?;
        let map = memmap2::MmapOptions::new().len(size).map_anon()?;
        let start = map.as_ptr().align_offset(HUGE).min(HUGE);
        #[cfg(target_os = "linux")]
        map.advise(memmap2::Advice::HugePage)?;
        Ok(HugeBuf { map, start, len })
    }

    /// `len` bytes of `src` read into a new buffer.
    pub fn read_from(src: &mut impl Read, len: usize) -> io::Result<Self> {
        let mut buf = HugeBuf::zeroed(len)?;
        src.read_exact(&mut buf)?;
        Ok(buf)
    }

    /// The first `len` bytes of `file` read into a new buffer, in 64 MiB pieces on the rayon
    /// pool: each page's first touch (the kernel zeroing 2 MiB) and its copy from the page cache
    /// run on every core, which halves an 8B model's load on two.
    #[cfg(unix)]
    pub fn read_file(file: &std::fs::File, len: usize) -> io::Result<Self> {
        use rayon::prelude::*;
        use std::os::unix::fs::FileExt;
        const PIECE: usize = 64 << 20;
        let mut buf = HugeBuf::zeroed(len)?;
        buf.par_chunks_mut(PIECE)
            .enumerate()
            .try_for_each(|(i, piece)| file.read_exact_at(piece, (i * PIECE) as u64))?;
        Ok(buf)
    }

    #[cfg(not(unix))]
    pub fn read_file(file: &std::fs::File, len: usize) -> io::Result<Self> {
        Self::read_from(&mut &*file, len)
    }

    /// The bytes, read-only from now on, as an owner for `weights::Bytes`.
    pub fn freeze(self) -> io::Result<Frozen> {
        Ok(Frozen {
            map: self.map.make_read_only()?,
            start: self.start,
            len: self.len,
        })
    }
}

impl Deref for HugeBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &self.map[self.start..self.start + self.len]
    }
}

impl DerefMut for HugeBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        &mut self.map[self.start..self.start + self.len]
    }
}

/// A `HugeBuf` made read-only.
pub struct Frozen {
    map: memmap2::Mmap,
    start: usize,
    len: usize,
}

impl AsRef<[u8]> for Frozen {
    fn as_ref(&self) -> &[u8] {
        &self.map[self.start..self.start + self.len]
    }
}

impl Frozen {
    /// How many of these bytes' mapping the kernel holds in huge pages now (`AnonHugePages`
    /// of its entry in `/proc/self/smaps`), where it reports it.
    pub fn huge_bytes(&self) -> Option<u64> {
        mapping_field(self.map.as_ptr() as usize, "AnonHugePages:")
    }
}

/// `field` of this process's mapping that contains `addr` (`/proc/self/smaps`), in bytes.
fn mapping_field(addr: usize, field: &str) -> Option<u64> {
    let text = std::fs::read_to_string("/proc/self/smaps").ok()?;
    vma_field_bytes(&text, addr, field)
}

/// How many bytes of the mappings holding `addrs` (each mapping counted once) the kernel
/// maps with 2 MiB entries now: a file's `FilePmdMapped`, memory's `AnonHugePages`
/// (`/proc/self/smaps`); `None` where it does not say.
pub fn huge_bytes_at(addrs: &[usize]) -> Option<u64> {
    let text = std::fs::read_to_string("/proc/self/smaps").ok()?;
    Some(huge_bytes_of_vmas(&text, addrs))
}

/// `huge_bytes_at` over the text of an `smaps`.
fn huge_bytes_of_vmas(smaps: &str, addrs: &[usize]) -> u64 {
    let mut inside = false;
    let mut total = 0;
    for line in smaps.lines() {
        if let Some((lo, hi)) = vma_range(line) {
            inside = addrs.iter().any(|a| (lo..hi).contains(a));
        } else if inside {
            total += ["FilePmdMapped:", "AnonHugePages:"]
                .iter()
                .filter_map(|f| kb_field(line, f))
                .sum::<u64>();
        }
    }
    total
}

/// A mapping's header line's address range (`7f00-7f40 r--p ...`).
fn vma_range(line: &str) -> Option<(usize, usize)> {
    let (lo, hi) = line.split_whitespace().next()?.split_once('-')?;
    Some((
        usize::from_str_radix(lo, 16).ok()?,
        usize::from_str_radix(hi, 16).ok()?,
    ))
}

/// `line`'s value in bytes where it is the `kB` field `field` (e.g. `AnonHugePages:`).
fn kb_field(line: &str, field: &str) -> Option<u64> {
    let v = line.strip_prefix(field)?;
    v.trim()
        .trim_end_matches("kB")
        .trim()
        .parse::<u64>()
        .ok()
        .map(|k| k * 1024)
}

/// A `kB` field (e.g. `AnonHugePages:`), in bytes, of the mapping of `smaps` that contains
/// `addr`.
fn vma_field_bytes(smaps: &str, addr: usize, field: &str) -> Option<u64> {
    let mut inside = false;
    for line in smaps.lines() {
        if let Some((lo, hi)) = vma_range(line) {
            inside = (lo..hi).contains(&addr);
        } else if inside {
            if let Some(v) = kb_field(line, field) {
                return Some(v);
            }
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn thp_mode_is_the_bracketed_word() {
        assert_eq!(
            parse_thp_mode("always [madvise] never\n").as_deref(),
            Some("madvise")
        );
        assert_eq!(
            parse_thp_mode("[always] madvise never").as_deref(),
            Some("always")
        );
        assert_eq!(parse_thp_mode("always madvise never"), None);
    }

    #[test]
    fn mem_available_in_bytes() {
        let t = "MemTotal:       24000000 kB\nMemAvailable:    2000000 kB\n";
        assert_eq!(mem_available(t), Some(2_048_000_000));
        assert_eq!(mem_available("MemTotal: 1 kB\n"), None);
    }

    #[test]
    fn huge_bytes_of_the_mapping_holding_an_address() {
        let t = "7f0000000000-7f0000400000 rw-p 00000000 00:00 0\nSize: 4096 kB\nAnonHugePages:    2048 kB\n\
                 7f0000400000-7f0000401000 r--p 00000000 00:00 0\nAnonHugePages:       0 kB\n";
        let f = "AnonHugePages:";
        assert_eq!(vma_field_bytes(t, 0x7f0000123456, f), Some(2 << 20));
        assert_eq!(vma_field_bytes(t, 0x7f0000400000, f), Some(0));
        assert_eq!(vma_field_bytes(t, 0x10, f), None);
        assert_eq!(vma_field_bytes(t, 0x7f0000123456, "FilePmdMapped:"), None);
    }

    #[test]
    fn huge_bytes_of_the_mappings_holding_addresses_each_once() {
        let t = "7f0000000000-7f0000400000 rw-p 00000000 00:00 0\nSize: 4096 kB\nAnonHugePages:    2048 kB\n\
                 7f0000400000-7f0000c00000 r--s 00000000 fd:01 12 /c/x.tiles\nFilePmdMapped:    6144 kB\nAnonHugePages:       0 kB\n\
                 7f0000c00000-7f0001000000 r--p 00000000 fd:01 13 /m/model.safetensors\nFilePmdMapped:    4096 kB\n";
        // two addresses in the file's mapping count it once
        let (anon, file) = (0x7f0000001000, 0x7f0000400000);
        assert_eq!(huge_bytes_of_vmas(t, &[file, file + 4096]), 6 << 20);
        assert_eq!(huge_bytes_of_vmas(t, &[anon, file]), 8 << 20);
        assert_eq!(huge_bytes_of_vmas(t, &[0x10]), 0);
        assert_eq!(huge_bytes_of_vmas(t, &[0x7f0000c00000]), 4 << 20);
    }

    /// The buffer starts on a 2 MiB boundary, holds what was read, and reads back the same
    /// once frozen; a short source is an error, not a partly zero buffer.
    #[test]
    fn reads_into_an_aligned_buffer() {
        let src: Vec<u8> = (0..5_000_000u32).map(|i| (i * 7 % 251) as u8).collect();
        let buf = HugeBuf::read_from(&mut &src[..], src.len()).expect("read");
        assert_eq!(buf.as_ptr() as usize % HUGE, 0);
        assert!(buf[..] == src[..]);
        let frozen = buf.freeze().expect("freeze");
        assert!(frozen.as_ref() == &src[..]);
        assert!(HugeBuf::read_from(&mut &src[..10], 11).is_err());
        assert!(HugeBuf::zeroed(0).expect("empty").is_empty());
    }

    /// A file read in pieces on the pool is the file, past a piece boundary and at an odd
    /// length; a file shorter than asked is an error.
    #[test]
    fn reads_a_file_in_pieces() {
        let dir = tempfile::tempdir().expect("dir");
        let path = dir.path().join("f");
        let bytes: Vec<u8> = (0..(64usize << 20) + 12_345)
            .map(|i| (i % 253) as u8)
            .collect();
        std::fs::write(&path, &bytes).expect("write");
        let f = std::fs::File::open(&path).expect("open");
        let buf = HugeBuf::read_file(&f, bytes.len()).expect("read");
        assert!(buf[..] == bytes[..]);
        assert!(HugeBuf::read_file(&f, bytes.len() + 1).is_err());
    }

    /// A file mapped at a 2 MiB boundary reads back as the file. One out of the page cache
    /// (written, synced, dropped from the cache) is read ahead into 2 MiB folios under the
    /// advice and kept by `open`, mapped in 2 MiB entries, where the filesystem makes large
    /// folios (ext4 from Linux 6.16, XFS): CI requires it where `scripts/test.sh` finds such a
    /// temporary directory (`REQUIRE_HUGE_FILE_MAPS`), and only prints it elsewhere.
    #[cfg(target_os = "linux")]
    #[test]
    fn a_file_out_of_the_page_cache_is_mapped_in_huge_pages() {
        use std::io::Write;
        use std::os::unix::io::AsRawFd;
        let dir = tempfile::tempdir_in(std::env::temp_dir()).expect("dir");
        let path = dir.path().join("f");
        let bytes: Vec<u8> = (0..16 * HUGE + 4321).map(|i| (i % 251) as u8).collect();
        let mut f = std::fs::File::create(&path).expect("create");
        f.write_all(&bytes).expect("write");
        f.sync_all().expect("sync");
        drop(f);
        let f = std::fs::File::open(&path).expect("open");
        let m = AlignedMap::map(&f, bytes.len()).expect("map");
        assert_eq!(m.as_ref().as_ptr() as usize % HUGE, 0);
        assert!(m.as_ref() == &bytes[..]);
        drop(m);
        // SAFETY: advice on an open file descriptor; the file's pages are clean after the sync
        unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
        let kept = AlignedMap::open(&f, bytes.len()).expect("open");
        eprintln!(
            "a file read back from disk: kept, in 2 MiB entries: {}",
            kept.is_some()
        );
        if let Some(m) = &kept {
            assert!(m.as_ref() == &bytes[..]);
            assert!(m.huge_bytes().is_some_and(|h| h >= 8 * HUGE as u64));
        }
        if std::env::var_os("REQUIRE_HUGE_FILE_MAPS").is_some() {
            assert!(kept.is_some(), "the file was not mapped in 2 MiB entries");
        }
    }

    /// On Linux with huge pages on (`madvise` or `always`: the kernel compacts memory for an
    /// advised region when it faults), a buffer read in is held in 2 MiB pages.
    #[test]
    fn a_read_buffer_is_in_huge_pages_where_they_are_on() {
        if !matches!(thp_mode().as_deref(), Some("always" | "madvise")) {
            // CI sets REQUIRE_HUGEPAGES (scripts/test.sh): there, a kernel without them fails
            assert!(
                std::env::var_os("REQUIRE_HUGEPAGES").is_none(),
                "transparent huge pages are {:?} here; unset REQUIRE_HUGEPAGES on such a machine",
                thp_mode()
            );
            eprintln!("transparent huge pages are off here: nothing to check");
            return;
        }
        let src = vec![3u8; 8 * HUGE];
        let buf = HugeBuf::read_from(&mut &src[..], src.len()).expect("read");
        let huge = buf.freeze().expect("freeze").huge_bytes();
        assert!(
            huge.is_some_and(|h| h >= 4 * HUGE as u64),
            "{huge:?} bytes in huge pages"
        );
    }
}
