//! The decode copies of `tile16.rs` kept on disk, one file per model directory, so that a start
//! maps them (as it maps the model) instead of making them again.
//!
//! A file: `MAGIC`, the header's length (u64 LE), the header (JSON: the key, the model directory
//! and, per matrix, its name and where its bytes are), then each matrix's copy at a 4 KiB boundary.
//! The key is a SHA-256 of the format version and of what the copies are made from (each model
//! file's stamp as it was opened, `weights::FileStamp`: path, size, modification time and, on Unix,
//! device, inode and change time; each matrix's name and shape): a model changed in place or
//! replaced gets a new copy, written over the old one. Files are written to a temporary name in the
//! same directory and renamed, so a crash leaves no half file under the real name, and two `bot`s
//! starting at once each write a whole one (the last rename wins; a process that mapped the other
//! keeps its own). Nothing here is the user's data: a file that does not check out is ignored and
//! written again, and a store removes the files of model directories that are gone (each as large
//! as its model).

use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::engine::cpu::tile16::Tiles;
use crate::engine::quant::QMatrix;
use crate::engine::weights::{Bytes, FileStamp, Map};

const MAGIC: &[u8; 8] = b"BOTTILE1";
/// Changes whenever the layout of `tile16.rs` or this file does.
const VERSION: u32 = 1;
const ALIGN: usize = 4096;

/// What decides whether a cache file holds the right copies: each model file's stamp as it
/// was opened (canonical path, size, modification time and (Unix) device, inode and change
/// time: a file replaced at the same path with the same size and time, `cp -p` or `rsync -a`,
/// is another key too, and one renamed over the path during a load leaves the key of the
/// bytes read); each matrix's name and shape. Strings go in with their lengths.
pub fn key(files: &[&FileStamp], ws: &[&QMatrix]) -> String {
    let mut h = Sha256::new();
    let mut put = |b: &[u8]| {
        h.update((b.len() as u64).to_le_bytes());
        h.update(b);
    };
    put(&VERSION.to_le_bytes());
    for f in files {
        put(f.path.to_string_lossy().as_bytes());
        put(&f.len.to_le_bytes());
        put(&f.mtime_ns.to_le_bytes());
        for v in f.unix {
            put(&v.to_le_bytes());
        }
    }
    for w in ws {
        put(w.name.as_bytes());
        for v in [w.rows, w.cols, w.params.bits, w.params.group_size] {
            put(&(v as u64).to_le_bytes());
        }
    }
    hex(&h.finalize())
}

/// The cache file of a model directory, in `dir`.
pub fn file_for(dir: &Path, model_dir: &Path) -> PathBuf {
    let canon = std::fs::canonicalize(model_dir).unwrap_or_else(|_| model_dir.to_path_buf());
    let h = Sha256::digest(canon.to_string_lossy().as_bytes());
    dir.join(format!("{}.tiles", &hex(&h)[..32]))
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

#[derive(Serialize, Deserialize)]
struct Header {
    key: String,
    /// The model directory the copies were made for (canonical), so that a later store can
    /// remove the files of models no longer there; absent in files written before.
    #[serde(default)]
    model: Option<String>,
    matrices: Vec<Entry>,
}

#[derive(Serialize, Deserialize)]
struct Entry {
    name: String,
    offset: usize,
    len: usize,
}

/// The copies of `ws` from `path`, mapped, where the file is there and holds them under `key`
/// (each matrix named and sized as expected); `None` otherwise.
pub fn load(path: &Path, key: &str, ws: &[&QMatrix]) -> Option<Vec<Tiles>> {
    let file = std::fs::File::open(path).ok()?;
    let len = usize::try_from(file.metadata().ok()?.len()).ok()?;
    let map = map_file(&file, len)?;
    let bytes = (*map).as_ref();
    let (header, _) = parse(bytes)?;
    if header.key != key || header.matrices.len() != ws.len() {
        return None;
    }
    header
        .matrices
        .iter()
        .zip(ws)
        .map(|(e, w)| {
            let fits = e.offset.checked_add(e.len).is_some_and(|end| end <= len);
            if e.name != w.name || !fits {
                return None;
            }
            Tiles::from_bytes(w, Bytes::slice_of(map.clone(), e.offset, e.len))
        })
        .collect()
}

/// The header and where the data begins; `None` for anything but this format.
fn parse(bytes: &[u8]) -> Option<(Header, usize)> {
    let rest = bytes.strip_prefix(MAGIC)?;
    let n = usize::try_from(u64::from_le_bytes(rest.get(..8)?.try_into().ok()?)).ok()?;
    let header: Header = serde_json::from_slice(rest.get(8..8usize.checked_add(n)?)?).ok()?;
    Some((header, MAGIC.len() + 8 + n))
}

/// Writes `copies` (one per matrix of `ws`, made for the model in `model_dir`) to `path`
/// under `key`, whole or not at all; then removes the other cache files in its directory
/// whose model directory is gone (`sweep_orphans`).
pub fn store(
    path: &Path,
    key: &str,
    model_dir: &Path,
    ws: &[&QMatrix],
    copies: &[&Tiles],
) -> io::Result<()> {
    let dir = path
        .parent()
        .ok_or_else(|| io::Error::other("cache path without a directory"))?;
    std::fs::create_dir_all(dir)?;
    let model = std::fs::canonicalize(model_dir)
        .unwrap_or_else(|_| model_dir.to_path_buf())
        .to_string_lossy()
        .into_owned();
    // the header's size depends on the offsets: the data starts past its widest form
    let room = header_room(key, &model, ws, copies);
    let mut at = (MAGIC.len() + 8 + room).next_multiple_of(ALIGN);
    let header = Header {
        key: key.to_string(),
        model: Some(model),
        matrices: ws
            .iter()
            .zip(copies)
            .map(|(w, t)| {
                let e = Entry {
                    name: w.name.clone(),
                    offset: at,
                    len: t.nbytes(),
                };
                at = (at + t.nbytes()).next_multiple_of(ALIGN);
                e
            })
            .collect(),
    };
    let text = serde_json::to_vec(&header).map_err(io::Error::other)?;
    sweep_stale_temporaries(dir);
    let mut tmp = tempfile::Builder::new()
        .prefix(TMP_PREFIX)
        .tempfile_in(dir)?;
    {
        let mut out = io::BufWriter::with_capacity(1 << 20, tmp.as_file_mut());
        out.write_all(MAGIC)?;
        out.write_all(&(text.len() as u64).to_le_bytes())?;
        out.write_all(&text)?;
        let mut pos = MAGIC.len() + 8 + text.len();
        for (e, t) in header.matrices.iter().zip(copies) {
            out.write_all(&vec![0u8; e.offset - pos])?;
            out.write_all(t.bytes())?;
            pos = e.offset + e.len;
        }
        out.flush()?;
    }
    tmp.as_file().sync_all()?;
    drop_written_pages(tmp.as_file());
    tmp.persist(path).map_err(|e| e.error)?;
    sweep_orphans(dir, path);
    Ok(())
}

/// Removes the cache files in `dir` (but `keep`) made for a model directory that no longer
/// holds a `config.json`: each is the size of its model, and a model deleted (or a snapshot
/// replaced by a newer revision) would otherwise leave it there for good. Files written
/// before the model was recorded, and anything not in this format, are left alone.
fn sweep_orphans(dir: &Path, keep: &Path) {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return;
    };
    for e in rd.flatten() {
        let p = e.path();
        if p == keep || p.extension().is_none_or(|x| x != "tiles") {
            continue;
        }
        let gone = read_header(&p)
            .and_then(|h| h.model)
            .is_some_and(|m| !Path::new(&m).join("config.json").is_file());
        if gone {
            let _ = std::fs::remove_file(&p);
        }
    }
}

/// A cache file's header, read without reading its data; `None` if it is not one.
fn read_header(path: &Path) -> Option<Header> {
    use std::io::Read;
    let mut f = std::fs::File::open(path).ok()?;
    let mut head = [0u8; MAGIC.len() + 8];
    f.read_exact(&mut head).ok()?;
    let n = u64::from_le_bytes(head[MAGIC.len()..].try_into().ok()?);
    // a header lists matrices, a few hundred bytes each: anything larger is not ours
    if &head[..MAGIC.len()] != MAGIC || n > 16 << 20 {
        return None;
    }
    let mut text = vec![0u8; n as usize];
    f.read_exact(&mut text).ok()?;
    serde_json::from_slice(&text).ok()
}

/// The cache files in `dir` and their total size in bytes (`bot doctor`).
pub fn usage(dir: &Path) -> (usize, u64) {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return (0, 0);
    };
    rd.flatten()
        .filter(|e| e.path().extension().is_some_and(|x| x == "tiles"))
        .filter_map(|e| e.metadata().ok())
        .fold((0, 0), |(n, b), m| (n + 1, b + m.len()))
}

/// Asks the kernel to drop the file's pages from the page cache (Linux; written and synced,
/// they are clean): a file just written sits there in 4 KiB pages, which a later start would
/// map as such, while one read back from disk comes in large folios (XFS; ext4 from Linux
/// 6.16) that map in 2 MiB entries (`resident.rs`).
fn drop_written_pages(file: &std::fs::File) {
    #[cfg(target_os = "linux")]
    {
        use std::os::fd::AsRawFd;
        // SAFETY: advice on an open descriptor; it changes no memory of this process
        unsafe { libc::posix_fadvise(file.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
    }
    #[cfg(not(target_os = "linux"))]
    let _ = file;
}

/// The start of a file being written (a process killed while writing leaves one behind).
const TMP_PREFIX: &str = ".writing-";

/// Removes files being written that were left more than an hour ago (by a process killed
/// while writing; one writing now touches its file far more often than that).
fn sweep_stale_temporaries(dir: &Path) {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return;
    };
    for e in rd.flatten() {
        let old = e
            .metadata()
            .and_then(|m| m.modified())
            .ok()
            .and_then(|t| t.elapsed().ok())
            .is_some_and(|age| age.as_secs() > 3600);
        if old && e.file_name().to_string_lossy().starts_with(TMP_PREFIX) {
            let _ = std::fs::remove_file(e.path());
        }
    }
}

/// An upper bound on the header's size: every offset written at its widest.
fn header_room(key: &str, model: &str, ws: &[&QMatrix], copies: &[&Tiles]) -> usize {
    let widest = Header {
        key: key.to_string(),
        model: Some(model.to_string()),
        matrices: ws
            .iter()
            .zip(copies)
            .map(|(w, t)| Entry {
                name: w.name.clone(),
                offset: usize::MAX,
                len: t.nbytes(),
            })
            .collect(),
    };
    serde_json::to_vec(&widest).map_or(0, |v| v.len())
}

/// Bytes free to this user on the filesystem holding `dir` (or its nearest existing
/// ancestor), where the platform says.
pub fn free_bytes(dir: &Path) -> Option<u64> {
    let mut d = dir;
    while !d.exists() {
        d = d.parent()?;
    }
    #[cfg(unix)]
    {
        use std::os::unix::ffi::OsStrExt;
        let c = std::ffi::CString::new(d.as_os_str().as_bytes()).ok()?;
        let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
        // SAFETY: `c` is a NUL-terminated path and `st` a statvfs the call fills
        if unsafe { libc::statvfs(c.as_ptr(), &mut st) } != 0 {
            return None;
        }
        Some(st.f_bavail as u64 * st.f_frsize as u64)
    }
    #[cfg(not(unix))]
    None
}

/// The file mapped read-only: in 2 MiB entries where the page cache allows (Linux,
/// `resident::AlignedMap`), else plainly.
fn map_file(file: &std::fs::File, len: usize) -> Option<Arc<dyn AsRef<[u8]> + Send + Sync>> {
    #[cfg(target_os = "linux")]
    if let Ok(m) = crate::engine::resident::AlignedMap::map(file, len) {
        return Some(Arc::new(m));
    }
    let _ = len;
    // SAFETY: read-only; a cache file is only ever replaced by a rename, never rewritten in
    // place, so a mapping keeps the bytes it had.
    let m = unsafe { memmap2::Mmap::map(file) }.ok()?;
    Some(Arc::new(Map(m)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::quant::testutil::named_qmatrices;

    fn mats() -> Vec<QMatrix> {
        named_qmatrices(&[(48, 256, 64), (32, 128, 32), (16, 512, 128)])
    }

    /// A stored file maps back to the same bytes; another key, another matrix list, a
    /// truncated or foreign file give `None` (the caller then makes the copies again).
    #[test]
    fn stores_and_maps_back_and_refuses_what_does_not_match() {
        let dir = tempfile::tempdir().expect("tempdir");
        let ws = mats();
        let refs: Vec<&QMatrix> = ws.iter().collect();
        let copies: Vec<Tiles> = ws.iter().map(|w| Tiles::of(w).expect("copy")).collect();
        let crefs: Vec<&Tiles> = copies.iter().collect();
        let path = dir.path().join("sub").join("m.tiles");
        store(&path, "k1", dir.path(), &refs, &crefs).expect("store");
        let back = load(&path, "k1", &refs).expect("maps back");
        for (a, b) in back.iter().zip(&copies) {
            assert_eq!(a.bytes(), b.bytes());
            assert_eq!((a.tiles, a.gpr, a.gshift), (b.tiles, b.gpr, b.gshift));
            assert_eq!(
                a.bytes().as_ptr() as usize % ALIGN,
                0,
                "4 KiB aligned in the map"
            );
        }
        assert!(load(&path, "k2", &refs).is_none(), "another key");
        assert!(load(&path, "k1", &refs[..2]).is_none(), "fewer matrices");
        let mut other = ws.clone();
        other[1].name = "renamed".into();
        let orefs: Vec<&QMatrix> = other.iter().collect();
        assert!(load(&path, "k1", &orefs).is_none(), "another name");
        let full = std::fs::read(&path).expect("read");
        std::fs::write(&path, &full[..full.len() - 1]).expect("truncate");
        assert!(load(&path, "k1", &refs).is_none(), "truncated");
        std::fs::write(&path, b"not a cache file at all").expect("write");
        assert!(load(&path, "k1", &refs).is_none(), "foreign");
        // written again over the bad one, whole
        store(&path, "k1", dir.path(), &refs, &crefs).expect("store again");
        assert!(load(&path, "k1", &refs).is_some());
        let names: Vec<_> = std::fs::read_dir(path.parent().expect("dir"))
            .expect("ls")
            .map(|e| e.expect("entry").file_name())
            .collect();
        assert_eq!(
            names,
            vec![std::ffi::OsString::from("m.tiles")],
            "no temporary left"
        );
        // one left by a process killed while writing, two hours ago, is swept; a fresh one not
        let cache = path.parent().expect("dir");
        let (stale, fresh) = (cache.join(".writing-a"), cache.join(".writing-b"));
        for p in [&stale, &fresh] {
            std::fs::write(p, b"part").expect("write");
        }
        let two_hours = std::time::SystemTime::now() - std::time::Duration::from_secs(7200);
        std::fs::File::options()
            .write(true)
            .open(&stale)
            .and_then(|h| h.set_modified(two_hours))
            .expect("set mtime");
        store(&path, "k1", dir.path(), &refs, &crefs).expect("store");
        assert!(!stale.exists() && fresh.exists());
    }

    /// Storing a model's copies removes the cache files of model directories gone (no
    /// `config.json`), and nothing else: another model's, a file from before the model was
    /// recorded, a foreign file, a file of another kind.
    #[test]
    fn a_store_sweeps_the_files_of_models_gone() {
        let root = tempfile::tempdir().expect("tempdir");
        let model = |name: &str| {
            let d = root.path().join(name);
            std::fs::create_dir_all(&d).expect("mkdir");
            std::fs::write(d.join("config.json"), b"{}").expect("write");
            d
        };
        let (a, b, c) = (model("a"), model("b"), model("c"));
        let cache = root.path().join("tiles");
        let ws = mats();
        let refs: Vec<&QMatrix> = ws.iter().collect();
        let copies: Vec<Tiles> = ws.iter().map(|w| Tiles::of(w).expect("copy")).collect();
        let crefs: Vec<&Tiles> = copies.iter().collect();
        for m in [&b, &c] {
            store(&file_for(&cache, m), "k", m, &refs, &crefs).expect("store");
        }
        let mut old = MAGIC.to_vec();
        let text = br#"{"key":"k","matrices":[]}"#;
        old.extend((text.len() as u64).to_le_bytes());
        old.extend(text);
        std::fs::write(cache.join("old.tiles"), &old).expect("write");
        std::fs::write(cache.join("junk.tiles"), b"not ours").expect("write");
        std::fs::write(cache.join("notes.txt"), b"mine").expect("write");
        std::fs::remove_dir_all(&c).expect("rm model c");
        assert!(file_for(&cache, &c).exists());
        store(&file_for(&cache, &a), "k", &a, &refs, &crefs).expect("store");
        assert!(
            !file_for(&cache, &c).exists(),
            "the gone model's file is swept"
        );
        for kept in [
            file_for(&cache, &a),
            file_for(&cache, &b),
            cache.join("old.tiles"),
            cache.join("junk.tiles"),
            cache.join("notes.txt"),
        ] {
            assert!(kept.exists(), "{} kept", kept.display());
        }
        let (n, bytes) = usage(&cache);
        assert_eq!(n, 4, "a, b, old and junk");
        assert!(bytes > 2 * copies.iter().map(|t| t.nbytes() as u64).sum::<u64>());
        assert!(
            load(&file_for(&cache, &b), "k", &refs).is_some(),
            "b's still loads"
        );
    }

    /// The key of the file at `f` as opened now.
    fn key_of(f: &Path, ws: &[&QMatrix]) -> String {
        key(&[&FileStamp::of_path(f)], ws)
    }

    /// The key changes with a model file's size or time and with a matrix's shape; a stamp
    /// taken at open keeps its key after another file is renamed over the path.
    #[test]
    fn the_key_follows_the_files_and_the_shapes() {
        let dir = tempfile::tempdir().expect("tempdir");
        let f = dir.path().join("model.safetensors");
        std::fs::write(&f, b"abc").expect("write");
        let ws = mats();
        let refs: Vec<&QMatrix> = ws.iter().collect();
        let k1 = key_of(&f, &refs);
        assert_eq!(k1, key_of(&f, &refs));
        std::fs::write(&f, b"abcd").expect("write");
        let k2 = key_of(&f, &refs);
        assert_ne!(k1, k2, "size");
        let opened = std::fs::File::open(&f).expect("open");
        let at_open = FileStamp::of(&opened, &f).expect("stamp");
        assert_ne!(k2, key(&[&at_open], &refs[..2]), "matrices");
        // the same size and time at the same path, another file (`cp -p` over it)
        let other = dir.path().join("other");
        std::fs::write(&other, b"wxyz").expect("write");
        let t = std::fs::metadata(&f)
            .and_then(|m| m.modified())
            .expect("mtime");
        std::fs::File::options()
            .write(true)
            .open(&other)
            .and_then(|h| h.set_modified(t))
            .expect("set mtime");
        std::fs::rename(&other, &f).expect("rename");
        #[cfg(unix)]
        assert_ne!(k2, key_of(&f, &refs), "another inode");
        // a load that opened the file before the rename keys the bytes it read
        assert_eq!(key(&[&at_open], &refs), k2);
        drop(opened);
        assert_ne!(
            file_for(dir.path(), Path::new("/a")),
            file_for(dir.path(), Path::new("/b"))
        );
    }
}
