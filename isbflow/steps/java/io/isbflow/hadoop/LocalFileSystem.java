package io.isbflow.hadoop;

import java.io.IOException;
import java.nio.file.Files;
import java.nio.file.attribute.PosixFilePermission;
import java.util.EnumSet;
import java.util.Set;

import org.apache.hadoop.fs.Path;
import org.apache.hadoop.fs.permission.FsPermission;
import org.apache.hadoop.io.nativeio.NativeIO;

/**
 * Hadoop's local file system (checksums and all), whose permissions are set by the JVM (java.nio)
 * instead of a {@code chmod} process. Without Hadoop's native library (pip's PySpark ships none),
 * RawLocalFileSystem runs {@code chmod} for every file and directory it creates: a checkpoint's
 * offset and commit files, their {@code .crc} twins, a write job's temporary directories and part
 * files. isbflow's session sets it as {@code fs.file.impl} on a local master
 * ({@code isbflow.steps.hadoop_fs}).
 */
public class LocalFileSystem extends org.apache.hadoop.fs.LocalFileSystem {
  public LocalFileSystem() {
    super(new Raw());
  }

  /** The raw (checksum-less) file system under it: Hadoop's, but for {@link #setPermission}. */
  public static class Raw extends org.apache.hadoop.fs.RawLocalFileSystem {
    /** POSIX permissions by the bit of a mode that grants them, lowest bit first. */
    private static final PosixFilePermission[] BITS = {
      PosixFilePermission.OTHERS_EXECUTE, PosixFilePermission.OTHERS_WRITE, PosixFilePermission.OTHERS_READ,
      PosixFilePermission.GROUP_EXECUTE, PosixFilePermission.GROUP_WRITE, PosixFilePermission.GROUP_READ,
      PosixFilePermission.OWNER_EXECUTE, PosixFilePermission.OWNER_WRITE, PosixFilePermission.OWNER_READ,
    };

    @Override
    public void setPermission(Path p, FsPermission permission) throws IOException {
      short mode = permission.toShort();
      if (NativeIO.isAvailable() || (mode & ~0777) != 0) {
        super.setPermission(p, permission);  // native, or a sticky bit java.nio cannot set
        return;
      }
      Set<PosixFilePermission> perms = EnumSet.noneOf(PosixFilePermission.class);
      for (int i = 0; i < BITS.length; i++) {
        if ((mode & (1 << i)) != 0) {
          perms.add(BITS[i]);
        }
      }
      Files.setPosixFilePermissions(pathToFile(p).toPath(), perms);
    }
  }
}
