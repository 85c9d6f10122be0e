// The embedded library source (see library_source.h; CMake writes the .inc).
#include "metal/library_source.h"

#include <cctype>
#include <cstddef>
#include <cstring>
#include <string>

namespace nbx::metal {

const char* LibrarySource() {
  return
#include "metal/library_source.inc"
      ;
}

namespace {

constexpr char kKernelDir[] = "xla_ffi/metal/kernels/";

// Whether [p, end) is CMake's marker of a file's start, `// ---- <file>` (the
// file's name alone: word characters and dots; the kernels' own `// ---- `
// comments have words and spaces); its name in *file.
bool Marker(const char* p, const char* end, std::string* file) {
  static constexpr char kPrefix[] = "// ---- ";
  const size_t n = sizeof(kPrefix) - 1;
  if (end - p <= static_cast<ptrdiff_t>(n) || std::strncmp(p, kPrefix, n) != 0) return false;
  for (const char* c = p + n; c < end; ++c)
    if (!std::isalnum(static_cast<unsigned char>(*c)) && *c != '_' && *c != '.') return false;
  file->assign(p + n, end);
  return true;
}

// The kernel file and its own line (1-based) of line `line` of LibrarySource().
bool FileLine(long line, std::string* file, long* file_line) {
  const char* p = LibrarySource();
  long marker = 0;
  for (long n = 1; *p != '\0'; ++n) {
    const char* end = std::strchr(p, '\n');
    if (end == nullptr) end = p + std::strlen(p);
    std::string name;
    if (Marker(p, end, &name)) {
      *file = name;
      marker = n;
    }
    if (n == line) {
      if (marker == 0 || marker == n) return false;
      *file_line = n - marker;
      return true;
    }
    if (*end == '\0') break;
    p = end + 1;
  }
  return false;
}

}  // namespace

std::string LibraryCompileError(const std::string& compiler_message) {
  static constexpr char kSource[] = "program_source:";
  const size_t n = sizeof(kSource) - 1;
  std::string out, first_file, error_file;
  size_t from = 0;
  for (size_t at; (at = compiler_message.find(kSource, from)) != std::string::npos;) {
    size_t digits = at + n;
    while (digits < compiler_message.size() && std::isdigit(static_cast<unsigned char>(compiler_message[digits])))
      ++digits;
    std::string file;
    long file_line = 0;
    const size_t width = digits - at - n;  // a line number of 1 to 9 digits
    if (width == 0 || width > 9 || !FileLine(std::stol(compiler_message.substr(at + n, width)), &file, &file_line)) {
      out.append(compiler_message, from, digits - from);  // left as it is
      from = digits;
      continue;
    }
    out.append(compiler_message, from, at - from);
    out += kKernelDir + file + ":" + std::to_string(file_line);
    if (first_file.empty()) first_file = file;
    // `program_source:LINE:COL: error: ...`: the file of the first error leads the message
    const size_t kind = compiler_message.find_first_not_of("0123456789:", digits);
    if (error_file.empty() && kind != std::string::npos &&
        compiler_message.compare(kind, 6, " error") == 0)
      error_file = file;
    from = digits;
  }
  out.append(compiler_message, from, std::string::npos);
  const std::string named = !error_file.empty() ? error_file : first_file;
  if (named.empty())
    return "the Metal compiler rejected the kernels' library (" + std::string(kKernelDir) +
           ": params.h then the .metal files, in prelude.metal's order): " + out;
  return "the Metal compiler rejected the kernels' library in " + std::string(kKernelDir) + named + ": " + out;
}

}  // namespace nbx::metal
