# Optional backends (docs/backends.md "Optional backends in the build"): the Metal device on Apple
# and the CUDA handler where nvcc is found.  Neither may break the install: each is compiled into the
# core only after a configure-time compile of its sources succeeded, so that a compile error there
# leaves a package with the CPU handler (and the reason, reported at run time) instead of a failed
# pip install.
#
#   nbx_optional_backend(<NAME> TARGET <target> LANGUAGE <lang> WHAT <words> SOURCES <file>...
#                        [UNSUPPORTED <why>] [COMPILE_OPTIONS <opt>...] [INCLUDE_DIRECTORIES <dir>...]
#                        [LINK_LIBRARIES <lib>...] [PROPERTIES <prop> <value>...])
#
# NBX_<NAME> (a cache string: AUTO, ON or OFF; AUTO by default):
#   OFF   never built;
#   AUTO  built when CMake finds a <lang> compiler and the probe compiles: the sources, as <target>
#         compiles them (its include directories, definitions and options, read from the target
#         when this is called, plus the arguments above), built as a small CMake project of
#         its own (cmake/optional_probe/) in <build>/optional/<name>, incrementally on every
#         configure.  On failure the configure warns with the first compiler error lines
#         and the package builds without the backend;
#   ON    built, or the configure fails (no compiler, UNSUPPORTED, or the probe's errors).
# UNSUPPORTED: why the backend cannot be built on this platform (AUTO: not built; ON: an error).
# Sets NBX_<NAME>_BUILT (ON/OFF) and NBX_<NAME>_NOT_BUILT (why not, a sentence; "" when built);
# nbx_optional_backends_header() writes them for the modules (NBX_WITH_<NAME>, NBX_<NAME>_NOT_BUILT).
#
# NBX_BREAK_OPTIONAL (a test switch; a list of lower-case names, e.g. "cuda"): those backends'
# sources are compiled with cmake/break_optional.h included first, whose #error breaks them, so
# that AUTO's fallback (and ON's failure) can be tested without a broken compiler
# (tests/library/test_packaging.py, .ci/sanitize).  The product's sources carry no hook.
include_guard(GLOBAL)
include(CheckLanguage)

set(NBX_BREAK_OPTIONAL "" CACHE STRING
    "Test switch: optional backends (cuda, metal) whose sources are compiled broken on purpose")
set(_NBX_OPTIONAL_DIR "${CMAKE_CURRENT_LIST_DIR}")
set(_NBX_OPTIONAL_NAMES cuda metal)  # what NBX_BREAK_OPTIONAL may name
foreach(_b IN LISTS NBX_BREAK_OPTIONAL)
  if(NOT _b IN_LIST _NBX_OPTIONAL_NAMES)
    message(FATAL_ERROR "NBX_BREAK_OPTIONAL names '${_b}': expected some of ${_NBX_OPTIONAL_NAMES}")
  endif()
endforeach()

# enable_language must be called at file scope, hence a macro around the two functions (the
# language is enabled only once the probe has compiled the sources).
macro(nbx_optional_backend name)
  _nbx_optional_probe(${name} ${ARGN})
  if(NBX_${name}_BUILT)
    enable_language(${NBX_${name}_LANGUAGE})
    _nbx_optional_add(${name} ${ARGN})
  endif()
endmacro()

set(_NBX_OPTIONAL_ONE TARGET LANGUAGE WHAT UNSUPPORTED)
set(_NBX_OPTIONAL_MANY SOURCES COMPILE_OPTIONS INCLUDE_DIRECTORIES LINK_LIBRARIES PROPERTIES)

function(_nbx_write_if_changed path text)
  if(EXISTS "${path}")
    file(READ "${path}" old)
    if(old STREQUAL text)
      return()
    endif()
  endif()
  file(WRITE "${path}" "${text}")
endfunction()

# The compiler's first error line in a build's output (headline) and up to 20 lines from it (shown);
# without one, the output's last lines.  (String operations only: a compiler's message may hold
# the ';' and '[' that CMake's lists split on.)
function(_nbx_first_errors headline_var shown_var out)
  string(REPLACE "\r" "" out "${out}")
  string(REGEX MATCH "(^|\n)((error|Error|fatal)[^A-Za-z]|[^\n]*[^A-Za-z_\n-](error|Error|fatal)[^A-Za-z])[^\n]*"
         m "${out}")
  if(m)
    string(FIND "${out}" "${m}" pos)
  else()
    string(LENGTH "${out}" pos)
    math(EXPR pos "${pos} > 2000 ? ${pos} - 2000 : 0")
  endif()
  string(SUBSTRING "${out}" ${pos} 6000 rest)
  string(REGEX REPLACE "^\n+" "" rest "${rest}")
  set(shown "")
  foreach(i RANGE 19)
    string(FIND "${rest}" "\n" nl)
    if(nl EQUAL -1)
      string(APPEND shown "  ${rest}")
      break()
    endif()
    string(SUBSTRING "${rest}" 0 ${nl} line)
    string(APPEND shown "  ${line}\n")  # indented: CMake's messages keep such lines as they are
    math(EXPR nl "${nl} + 1")
    string(SUBSTRING "${rest}" ${nl} -1 rest)
  endforeach()
  string(FIND "${shown}" "\n" nl)
  string(SUBSTRING "${shown}" 0 ${nl} headline)
  string(STRIP "${headline}" headline)
  string(LENGTH "${headline}" len)
  if(len GREATER 300)
    string(SUBSTRING "${headline}" 0 300 headline)
    string(APPEND headline "...")
  endif()
  set(${headline_var} "${headline}" PARENT_SCOPE)
  set(${shown_var} "${shown}" PARENT_SCOPE)
endfunction()

# `set(<var> [==[v1]==] [==[v2]==] ...)`, appended to out: a list written for the probe verbatim
function(_nbx_probe_set out var)
  set(line "set(${var}")
  foreach(v IN LISTS ARGN)
    string(APPEND line " [==[${v}]==]")
  endforeach()
  set(${out} "${${out}}${line})\n" PARENT_SCOPE)
endfunction()

function(_nbx_optional_probe name)
  cmake_parse_arguments(PARSE_ARGV 1 A "" "${_NBX_OPTIONAL_ONE}" "${_NBX_OPTIONAL_MANY}")
  string(TOLOWER "${name}" lower)
  set(NBX_${name} "AUTO" CACHE STRING "Build ${A_WHAT}: AUTO, ON or OFF")
  set_property(CACHE NBX_${name} PROPERTY STRINGS AUTO ON OFF)
  string(TOUPPER "${NBX_${name}}" mode)
  if(NOT mode MATCHES "^(AUTO|ON|OFF)$")
    message(FATAL_ERROR "NBX_${name}=${NBX_${name}}: expected AUTO, ON or OFF")
  endif()
  set(options ${A_COMPILE_OPTIONS})
  if(lower IN_LIST NBX_BREAK_OPTIONAL)
    list(APPEND options -include "${_NBX_OPTIONAL_DIR}/break_optional.h")
  endif()
  set(built OFF)
  set(why "")
  if(mode STREQUAL "OFF")
    set(why "this build of jax_nbx has no ${A_WHAT}: it was built with NBX_${name}=OFF")
  elseif(A_UNSUPPORTED)
    set(why "this build of jax_nbx has no ${A_WHAT}: ${A_UNSUPPORTED}")
  else()
    check_language(${A_LANGUAGE})
    if(NOT CMAKE_${A_LANGUAGE}_COMPILER)
      set(why "this build of jax_nbx has no ${A_WHAT}: no ${A_LANGUAGE} compiler was found when it was built")
    else()
      # The probe: a project of its own, configured from the settings written here.
      set(bindir "${CMAKE_BINARY_DIR}/optional/${lower}")
      get_target_property(includes ${A_TARGET} INCLUDE_DIRECTORIES)
      get_target_property(system_includes ${A_TARGET} INTERFACE_SYSTEM_INCLUDE_DIRECTORIES)
      get_target_property(definitions ${A_TARGET} COMPILE_DEFINITIONS)
      get_target_property(target_options ${A_TARGET} COMPILE_OPTIONS)
      set(config "# written by cmake/optional_backend.cmake for ${A_TARGET}'s ${lower} sources\n")
      foreach(v CMAKE_TOOLCHAIN_FILE CMAKE_BUILD_TYPE CMAKE_CXX_COMPILER CMAKE_CXX_FLAGS
                CMAKE_${A_LANGUAGE}_COMPILER CMAKE_${A_LANGUAGE}_FLAGS CMAKE_${A_LANGUAGE}_HOST_COMPILER
                CMAKE_CXX_STANDARD CMAKE_${A_LANGUAGE}_STANDARD CMAKE_OSX_ARCHITECTURES
                CMAKE_OSX_DEPLOYMENT_TARGET CMAKE_OSX_SYSROOT)
        if(DEFINED ${v})
          _nbx_probe_set(config ${v} "${${v}}")
        endif()
      endforeach()
      foreach(v IN ITEMS includes system_includes definitions target_options)
        if(NOT ${v})
          set(${v} "")
        endif()
      endforeach()
      _nbx_probe_set(config NBX_PROBE_LANGUAGE ${A_LANGUAGE})
      set(sources "")
      foreach(src IN LISTS A_SOURCES)
        get_filename_component(src "${src}" ABSOLUTE BASE_DIR "${CMAKE_CURRENT_SOURCE_DIR}")
        list(APPEND sources "${src}")
      endforeach()
      _nbx_probe_set(config NBX_PROBE_SOURCES ${sources})
      _nbx_probe_set(config NBX_PROBE_SOURCE_OPTIONS ${options})
      _nbx_probe_set(config NBX_PROBE_OPTIONS ${target_options})
      _nbx_probe_set(config NBX_PROBE_INCLUDES ${includes} ${A_INCLUDE_DIRECTORIES})
      _nbx_probe_set(config NBX_PROBE_SYSTEM_INCLUDES ${system_includes})
      _nbx_probe_set(config NBX_PROBE_DEFINITIONS ${definitions})
      _nbx_probe_set(config NBX_PROBE_PROPERTIES ${A_PROPERTIES})
      file(MAKE_DIRECTORY "${bindir}")
      _nbx_write_if_changed("${bindir}/probe_config.cmake" "${config}")
      message(STATUS "jax_nbx: compiling the ${A_WHAT}'s sources (the ${lower} probe in ${bindir})")
      set(generator -G "${CMAKE_GENERATOR}")
      if(CMAKE_GENERATOR_PLATFORM)
        list(APPEND generator -A "${CMAKE_GENERATOR_PLATFORM}")
      endif()
      if(CMAKE_GENERATOR_TOOLSET)
        list(APPEND generator -T "${CMAKE_GENERATOR_TOOLSET}")
      endif()
      if(CMAKE_MAKE_PROGRAM)
        list(APPEND generator "-DCMAKE_MAKE_PROGRAM=${CMAKE_MAKE_PROGRAM}")
      endif()
      execute_process(
        COMMAND "${CMAKE_COMMAND}" -S "${_NBX_OPTIONAL_DIR}/optional_probe" -B "${bindir}" ${generator}
                "-DNBX_PROBE_CONFIG=${bindir}/probe_config.cmake"
        RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
      if(rc EQUAL 0)
        execute_process(COMMAND "${CMAKE_COMMAND}" --build "${bindir}" --target nbx_probe
                        RESULT_VARIABLE rc OUTPUT_VARIABLE build_out ERROR_VARIABLE build_out)
        string(APPEND out "${build_out}")
      endif()
      if(rc EQUAL 0)
        set(ok TRUE)
      else()
        set(ok FALSE)
      endif()
      if(ok)
        set(built ON)
      else()
        file(WRITE "${bindir}/probe.log" "${out}")
        _nbx_first_errors(headline shown "${out}")
        string(REPLACE "${CMAKE_SOURCE_DIR}/" "" headline "${headline}")
        string(CONCAT why "the ${A_WHAT} failed to compile when jax_nbx was built: ${headline}; the build's "
               "CMake output has the first errors, and NBX_${name}=ON makes the failure fatal "
               "(docs/backends.md)")
        set(detail "the ${A_WHAT} failed to compile (the ${lower} probe; its whole log: ${bindir}/probe.log):\n${shown}")
      endif()
    endif()
  endif()
  if(NOT built AND mode STREQUAL "ON")
    if(DEFINED detail)
      message(FATAL_ERROR "NBX_${name}=ON: ${detail}")
    endif()
    message(FATAL_ERROR "NBX_${name}=ON: ${why}")
  endif()
  if(built)
    message(STATUS "jax_nbx: building the ${A_WHAT}")
  elseif(DEFINED detail)
    message(WARNING "jax_nbx: building without the ${A_WHAT} (NBX_${name}=AUTO): ${detail}\n"
                    "jax_nbx will report at run time: ${why}")
  else()
    message(STATUS "jax_nbx: ${why}")
  endif()
  set(NBX_${name}_LANGUAGE ${A_LANGUAGE} PARENT_SCOPE)
  set(NBX_${name}_BUILT ${built} PARENT_SCOPE)
  set(NBX_${name}_NOT_BUILT "${why}" PARENT_SCOPE)
endfunction()

function(_nbx_optional_add name)
  cmake_parse_arguments(PARSE_ARGV 1 A "" "${_NBX_OPTIONAL_ONE}" "${_NBX_OPTIONAL_MANY}")
  set_source_files_properties(${A_SOURCES} PROPERTIES LANGUAGE ${A_LANGUAGE} COMPILE_OPTIONS "${A_COMPILE_OPTIONS}")
  target_sources(${A_TARGET} PRIVATE ${A_SOURCES})
  if(A_INCLUDE_DIRECTORIES)
    target_include_directories(${A_TARGET} PRIVATE ${A_INCLUDE_DIRECTORIES})
  endif()
  if(A_LINK_LIBRARIES)
    target_link_libraries(${A_TARGET} PRIVATE ${A_LINK_LIBRARIES})
  endif()
  if(A_PROPERTIES)
    set_target_properties(${A_TARGET} PROPERTIES ${A_PROPERTIES})
  endif()
endfunction()

# The header the modules read (NBX_WITH_<NAME> where built; NBX_<NAME>_NOT_BUILT, why not), written
# only when its content changes.
function(nbx_optional_backends_header path)
  set(text "// Generated by cmake/optional_backend.cmake: which optional backends this build has.\n#pragma once\n")
  foreach(name IN LISTS ARGN)
    if(NBX_${name}_BUILT)
      string(APPEND text "#define NBX_WITH_${name} 1\n")
    endif()
    set(s "${NBX_${name}_NOT_BUILT}")
    string(REPLACE "\\" "\\\\" s "${s}")
    string(REPLACE "\"" "\\\"" s "${s}")
    string(REPLACE "\n" "\\n" s "${s}")
    string(APPEND text "#define NBX_${name}_NOT_BUILT \"${s}\"\n")
  endforeach()
  _nbx_write_if_changed("${path}" "${text}")
endfunction()
